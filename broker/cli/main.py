"""The ``tidemark`` command line (DESIGN §8). Exit 0 ok, 1 runtime failure, 2 bad usage/config."""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from typing import Any, NoReturn

from broker.cli.demo import run_demo
from broker.cli.quarantine import show_quarantine
from broker.cli.verify import verify_data_dir
from broker.client import BrokerClient, BrokerError, Message, Receipt
from broker.config import Config, ConfigError
from broker.daemon import logsetup, plugins
from broker.daemon.server import serve
from broker.group_slots import slot_of
from broker.invariant import StartupRefused
from broker.logformat import system_records
from broker.security import auth, tls
from broker.security.auth import read_token
from broker.storage.dirlock import DirLock

EXIT_FAILURE = 1
EXIT_USAGE = 2


def _fail(message: str, code: int = EXIT_FAILURE) -> int:
    print(f"tidemark: {message}", file=sys.stderr)
    return code


TOKEN_ENV = "TIDEMARK_TOKEN"


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line and exit 2 (``--help`` still prints the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message}\n")


def _positive(text: str) -> int:
    return _integer(text, 1)


def _non_negative(text: str) -> int:
    return _integer(text, 0)


def _integer(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
    return value


def _addresses(text: str) -> str:
    """HOST:PORT[,HOST:PORT...] with ports 1..65535 (gRPC would wrap 99999 silently)."""
    for address in (a.strip() for a in text.split(",")):
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise argparse.ArgumentTypeError(f"{address[:200]!r} is not HOST:PORT with a port 1..65535")
    return text


def _connection_flags() -> _Parser:
    """--broker and the TLS/token options every client subcommand takes."""
    c = _Parser(add_help=False)
    c.add_argument("--broker", required=True, type=_addresses, help="HOST:PORT[,HOST:PORT...]")
    c.add_argument("--tls-ca", help="PEM CA bundle: connect with TLS and verify the broker against it")
    c.add_argument("--tls-cert", help="PEM client certificate (a broker with tls.client_ca_file asks for one)")
    c.add_argument("--tls-key", help="PEM private key of --tls-cert")
    c.add_argument("--token-file", help=f"file holding the bearer token (default: ${TOKEN_ENV})")
    return c


def _add_txn_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    tx = sub.add_parser("txn", help="list, describe or abort transactions")
    txs = tx.add_subparsers(dest="txn_command", required=True)
    txl = txs.add_parser("list", parents=[conn], help="the open transactions, oldest first")
    txl.add_argument("--json", action="store_true")
    txd = txs.add_parser("describe", parents=[conn], help="a transactional id's latest transaction")
    txd.add_argument("transactional_id")
    txd.add_argument("--json", action="store_true")
    txa = txs.add_parser("abort", parents=[conn], help="abort a transactional id's open transaction (admin)")
    txa.add_argument("transactional_id")
    txa.add_argument("--json", action="store_true")


def _add_status_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    st = sub.add_parser("status", parents=[conn])
    st.add_argument("--json", action="store_true")
    cl = sub.add_parser("cluster", help="a cluster of shards: its shards, masters and queues")
    cls = cl.add_subparsers(dest="cluster_command", required=True)
    clst = cls.add_parser("status", parents=[conn], help="every shard: master, epoch, nodes, queues (any node answers)")
    clst.add_argument("--json", action="store_true")
    clr = cls.add_parser("rebalance", parents=[conn], help="even out the shards' queues with the fewest moves")
    clr.add_argument("--dry-run", action="store_true", help="print the plan, move nothing")
    cld = cls.add_parser("drain", parents=[conn], help="move every queue off SHARD; no new queue goes there")
    cld.add_argument("shard")
    cld.add_argument("--cancel", action="store_true", help="the shard takes queues again (nothing moves back)")
    cld.add_argument("--dry-run", action="store_true", help="print the plan, mark and move nothing")
    csm = cls.add_parser("move-slot", parents=[conn], help="move a group slot (its groups' offsets and its "
                         "transactional ids) to SHARD")
    csm.add_argument("slot", nargs="?", type=_non_negative, help="the slot (0..255); or --group")
    csm.add_argument("--group", default="", help="the slot of this group (or transactional id)")
    csm.add_argument("--to", required=True, metavar="SHARD", help="the shard to move it to")
    csm.add_argument("--timeout-ms", type=_non_negative, default=120_000, help="how long to wait for the move")
    q = sub.add_parser("queue", help="a cluster of shards: move a queue to another shard (no data copied)")
    qs = q.add_subparsers(dest="queue_command", required=True)
    qm = qs.add_parser("move", parents=[conn], help="seal the queue where it is and continue it on SHARD")
    qm.add_argument("topic")
    qm.add_argument("queue", type=_non_negative)
    qm.add_argument("--to", required=True, metavar="SHARD", help="the shard to move it to")
    qm.add_argument("--timeout-ms", type=_non_negative, default=30_000, help="how long to wait for the move")


def _cancel_parser(sub: Any, conn: argparse.ArgumentParser) -> None:
    ca = sub.add_parser("cancel", parents=[conn], help="cancel a scheduled (timer) message before it fires")
    ca.add_argument("--timer-offset", type=_non_negative, required=True)
    ca.add_argument("--topic", default="", help="the message's topic (its receipt's); required in a cluster of shards")
    ca.add_argument("--queue", type=_non_negative, default=0, help="the message's queue (with --topic)")
    ca.add_argument("--shard", default="", help="the shard holding the timer (its receipt's), once its queue moved")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tidemark", description="Tidemark broker daemon and tools")
    conn = _connection_flags()
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config")
    s.add_argument("--data-dir")
    s.add_argument("--listen")
    s.add_argument("--role", choices=("auto", "master", "slave"))
    s.add_argument("--master")
    s.add_argument("--metrics-listen")

    sub.add_parser("demo", help="start a real daemon in a temporary directory and show what it does")

    t = sub.add_parser("topic", help="create, list or delete topics")
    tsub = t.add_subparsers(dest="topic_command", required=True)
    tc = tsub.add_parser("create", parents=[conn])
    tc.add_argument("name", nargs="+", help="one or more names (many: CreateTopics calls of up to "
                    f"{system_records.CREATE_TOPICS_MAX}, each all or none)")
    tc.add_argument("--queues", type=_positive, default=1, help=f"1..{system_records.QUEUES_MAX}")
    tl = tsub.add_parser("list", parents=[conn])
    tl.add_argument("--all", action="store_true", help="include system topics")
    td = tsub.add_parser("delete", parents=[conn])
    td.add_argument("name")
    tds = tsub.add_parser("describe", parents=[conn], help="queues: min/max offsets, bytes, local and tiered ranges")
    tds.add_argument("name")
    tds.add_argument("--json", action="store_true")

    se = sub.add_parser("send", parents=[conn], help="send one message per stdin line; print one JSON receipt per line")
    se.add_argument("topic")
    se.add_argument("--key")
    se.add_argument("--delay-ms", type=_non_negative, help="deliver each message this long after it is sent (a timer message)")
    se.add_argument("--ack", choices=("leader", "flush", "replica"), default="replica")
    se.add_argument("--batch", type=_positive, default=1000, help="lines per request")

    _cancel_parser(sub, conn)

    co = sub.add_parser("consume", parents=[conn], help="print one JSON object per message")
    co.add_argument("topic")
    co.add_argument("--group", help="consume as a member of this group: its members share the queues, and each "
                    "starts from the group's committed offsets")
    co.add_argument("--from", dest="start", choices=("earliest", "latest", "committed"), default="earliest",
                    help="where to start (with --group: where a queue without a committed offset starts)")
    co.add_argument("--session-timeout-ms", type=_positive, default=10_000, help="with --group: the member's session")
    co.add_argument("--pop", action="store_true", help="with --group: pop mode, per-message leases shared by any "
                    "number of consumers; acks what it printed")
    co.add_argument("--invisible-ms", type=_positive, default=30_000, help="with --pop: the lease of each message")
    co.add_argument("--max", type=_non_negative, default=0, help="stop after N messages (0: no limit)")
    co.add_argument("--timeout-ms", type=_non_negative, default=1000, help="stop after this long without messages")
    co.add_argument("--isolation", choices=("read_committed", "read_uncommitted"), default="read_committed",
                    help="transactions' messages: once committed (default), or as written (open and aborted ones too)")

    _add_txn_commands(sub, conn)

    gr = sub.add_parser("group", help="list, describe consumer groups; reset a group's offsets")
    gsub = gr.add_subparsers(dest="group_command", required=True)
    gl = gsub.add_parser("list", parents=[conn])
    gl.add_argument("--json", action="store_true")
    gd = gsub.add_parser("describe", parents=[conn])
    gd.add_argument("group")
    gd.add_argument("--json", action="store_true")
    gx = gsub.add_parser("reset-offsets", parents=[conn], help="refused while the group has live members")
    gx.add_argument("group")
    gx.add_argument("--topic", required=True)
    gx.add_argument("--to", required=True, help="earliest | latest | time:MS | offset:N")

    pr = sub.add_parser("promote", parents=[conn], help="make a slave the master (a new epoch)")
    pr.add_argument("--unclean", action="store_true", help="even if not known to be in sync (may lose data)")
    dm = sub.add_parser("demote", parents=[conn], help="make a master follow another master")
    dm.add_argument("--master", required=True)

    _add_status_commands(sub, conn)

    cf = sub.add_parser("config", help="configuration tools")
    cfs = cf.add_subparsers(dest="config_command", required=True)
    cc = cfs.add_parser("check")
    cc.add_argument("file")

    lg = sub.add_parser("log", help="commit-log tools")
    lgs = lg.add_subparsers(dest="log_command", required=True)
    lv = lgs.add_parser("verify")
    lv.add_argument("data_dir")
    lq = lgs.add_parser("quarantine", help="what was cut from the log and kept in DATA_DIR/quarantine (reads only)")
    lq.add_argument("data_dir")
    lq.add_argument("--records", action="store_true", help="one JSON object per record of the cut batches, body in base64")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    cmd = args.command
    try:
        if cmd == "serve":
            return _serve(args)
        if cmd == "demo":

            return run_demo()
        if cmd == "config":

            cfg = Config.load(args.file)
            tls.check_files(cfg)  # certificate, key and token files must exist and parse
            if cfg["auth.token_file"]:
                auth.read_token(cfg["auth.token_file"])
            print(f"{args.file}: ok ({len(cfg.as_dict())} settings)")
            return 0
        if cmd == "log":
            if args.log_command == "quarantine":
                return show_quarantine(args.data_dir, records=args.records, out=sys.stdout, err=sys.stderr)
            return verify_data_dir(args.data_dir)
        if cmd == "topic":
            return _topic(args)
        if cmd == "send":
            return _send(args)
        if cmd == "consume":
            return _consume(args)
        if cmd == "group":
            return _group(args)
        if cmd == "txn":
            return _txn(args)
        if cmd == "cancel":
            with _client(args) as c:
                target = Receipt(args.topic, args.queue, 0, 0, timer_offset=args.timer_offset,
                                 shard=args.shard or None) if args.topic else None
                try:
                    print(json.dumps({"cancelled": c.cancel_timer(target or args.timer_offset)}))
                except ValueError as exc:
                    return _fail(f"{exc} (give --topic and --queue)", EXIT_USAGE)
            return 0
        if cmd == "status":
            return _status(args)
        if cmd == "cluster":
            if args.cluster_command == "status":
                return _cluster_status(args)
            if args.cluster_command == "move-slot":
                return _move_slot(args)
            return _rebalance(args)
        if cmd == "queue":
            with _client(args) as c:
                segments = c.move_queue(args.topic, args.queue, args.to, timeout_ms=args.timeout_ms)
            print(json.dumps({"moved": {"topic": args.topic, "queue": args.queue, "to": args.to}, "segments": segments}))
            return 0
        if cmd == "promote":
            with _client(args) as c:
                print(json.dumps({"promoted": args.broker, "epoch": c.promote(unclean=args.unclean)}))
            return 0
        if cmd == "demote":
            with _client(args) as c:
                c.demote(master=args.master)
            print(json.dumps({"demoted": args.broker, "master": args.master}))
            return 0
    except BrokerError as exc:
        code = EXIT_USAGE if exc.code.name in ("INVALID_ARGUMENT",) else EXIT_FAILURE
        return _fail(f"{exc.code.name}: {exc.details}", code)
    raise AssertionError(cmd)


def _serve(args: argparse.Namespace) -> int:

    overrides = {
        "node.data_dir": args.data_dir, "node.listen": args.listen, "node.role": args.role,
        "node.master": args.master, "node.metrics_listen": args.metrics_listen,
    }
    cfg = Config.load(args.config, overrides)
    logsetup.configure(cfg["log.level"], cfg["log.format"])

    def prestart(config: Config, lock: DirLock) -> None:
        for _name, hook in plugins.load(plugins.PRESTART):  # e.g. a slave's bootstrap from its master
            hook(config, lock)

    try:
        return serve(cfg, load_config=lambda: Config.load(args.config, overrides), prestart=prestart)
    except StartupRefused as exc:
        return _fail(f"refusing to start: {exc}")


def _client(args: argparse.Namespace) -> Any:

    token = os.environ.get(TOKEN_ENV) or None
    if args.token_file:
        token = read_token(args.token_file, "--token-file")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    try:
        return BrokerClient([a.strip() for a in args.broker.split(",") if a.strip()], token=token,
                            tls_ca_file=args.tls_ca, tls_cert_file=args.tls_cert, tls_key_file=args.tls_key)
    except OSError as exc:
        raise ConfigError(f"{exc.filename}: cannot read: {exc.strerror}") from None


def _topic(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.topic_command == "create":
            if len(args.name) == 1:
                c.create_topic(args.name[0], queues=args.queues)
            step = system_records.CREATE_TOPICS_MAX
            for i in range(0, len(args.name) if len(args.name) > 1 else 0, step):
                c.create_topics(dict.fromkeys(args.name[i : i + step], args.queues))
            for name in args.name:
                print(json.dumps({"created": name, "queues": args.queues}))
        elif args.topic_command == "describe":
            _print_described(c.describe_topic(args.name), args.json, "queues")
        elif args.topic_command == "delete":
            c.delete_topic(args.name)
            print(json.dumps({"deleted": args.name}))
        else:
            for name, info in c.list_topics(include_system=args.all).items():
                print(json.dumps({"name": name, **info}))
    return 0


def _send(args: argparse.Namespace) -> int:

    if args.delay_ms is not None and args.delay_ms < 0:
        return _fail("--delay-ms: must not be negative", EXIT_USAGE)
    with _client(args) as c:
        pending: list[Message] = []

        def flush() -> None:
            for r in c.send(args.topic, pending, ack=args.ack):
                out = {"topic": r.topic, "queue_id": r.queue_id, "queue_offset": r.queue_offset,
                       "commit_offset": r.commit_offset}
                if r.timer_offset is not None:
                    out.update(timer_offset=r.timer_offset, deliver_at_ms=r.deliver_at_ms)
                print(json.dumps(out))
            pending.clear()

        for line in sys.stdin.buffer:
            at = int(time.time() * 1000) + args.delay_ms if args.delay_ms else None
            pending.append(Message(body=line.rstrip(b"\n"), key=args.key, deliver_at_ms=at))
            if len(pending) >= args.batch:
                flush()
        if pending:
            flush()
        sys.stdout.flush()
    return 0


def _timer_json(m: Any) -> dict[str, int]:
    at = m.deliver_at_ms
    return {} if at is None else {"deliver_at_ms": at, "timer_offset": m.timer_offset}


def _body_json(body: bytes) -> dict[str, str]:
    try:
        return {"body": body.decode()}
    except UnicodeDecodeError:
        return {"body_base64": base64.b64encode(body).decode()}


def _print_described(info: dict[str, Any], as_json: bool, rows: str) -> None:
    """``--json``: the whole object; else its scalar fields, then one line per row of ``rows``."""
    if as_json:
        print(json.dumps(info, indent=2))
        return
    print(" ".join(f"{k}={v}" for k, v in info.items() if not isinstance(v, list)))
    for row in info[rows]:
        print("  " + " ".join(f"{k}={v}" for k, v in row.items()))


def _group(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.group_command == "list":
            groups = c.list_groups()
            for g in groups:
                print(json.dumps(g) if args.json else f"{g['name']} members={g['members']} lag={g['lag']} "
                      f"topics={','.join(g['topics'])}")
        elif args.group_command == "describe":
            info = c.describe_group(args.group)
            if not args.json:
                for m in info["members"]:
                    print(f"member {m['member_id']} client={m['client_id']} queues="
                          + ",".join(f"{t}/{q}" for t, q in m["assigned"]))
                info = {k: v for k, v in info.items() if k != "members"}
            _print_described(info, args.json, "queues")
        else:
            try:
                offsets = c.reset_offsets(args.group, args.topic, args.to)
            except ValueError as exc:
                return _fail(str(exc), EXIT_USAGE)
            for q, o in sorted(offsets.items()):
                print(json.dumps({"group": args.group, "topic": args.topic, "queue_id": q, "offset": o}))
    return 0


def _txn(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.txn_command == "list":
            rows = c.list_transactions()
        elif args.txn_command == "describe":
            rows = [c.describe_transaction(args.transactional_id)]
        else:
            rows = [c.abort_transaction(args.transactional_id)]
    for t in rows:
        print(json.dumps(t) if args.json else
              f"{t['transactional_id']} {t['state']} producer_id={t['producer_id']} age_ms={t['age_ms']} "
              f"write_age_ms={t['write_age_ms']} timeout_ms={t['timeout_ms']}"
              + (f" reason={t['reason']}" if t["reason"] else "")
              + (" queues=" + ",".join(f"{q['topic']}/{q['queue_id']}@{q['first_offset']}" for q in t["queues"])
                 if t["queues"] else ""))
    return 0


def _message_json(m: Any) -> str:
    return json.dumps({"topic": m.topic, "queue_id": m.queue_id, "queue_offset": m.queue_offset,
                       "commit_offset": m.commit_offset, "key": m.key, "properties": m.properties,
                       "store_time_ms": m.store_time_ms, **_timer_json(m), **_body_json(m.body)})


def _consume_group(args: argparse.Namespace) -> int:
    """Subscribe mode: a member of ``--group``; commits what it printed after each batch and leaves
    the group at the end. ``--timeout-ms`` counts from when the member holds its first queue."""
    with _client(args) as c:
        c.describe_topic(args.topic)  # NOT_FOUND for an unknown topic, before joining
        reset = "latest" if args.start == "latest" else "earliest"
        with c.consumer(args.group, [args.topic], session_timeout_ms=args.session_timeout_ms,
                        auto_offset_reset=reset, isolation=args.isolation) as cons:
            # the master may hold new grants back briefly after it starts (groups.rejoin_grace_ms)
            join_deadline = time.monotonic() + (args.session_timeout_ms + 30_000) / 1000.0
            printed = 0
            while not args.max or printed < args.max:
                cons.max_messages = 1000 if not args.max else min(1000, args.max - printed)
                waiting = not cons.assignment and time.monotonic() < join_deadline
                msgs = cons.poll(timeout_ms=100 if waiting else args.timeout_ms)
                if not msgs and not waiting:
                    break
                for m in msgs:
                    print(_message_json(m))
                printed += len(msgs)
                sys.stdout.flush()
                cons.commit()
        sys.stdout.flush()
    return 0


def _consume_pop(args: argparse.Namespace) -> int:
    """Pop mode: lease, print, ack (an unprinted message's lease expires and it comes back)."""
    if args.start == "committed":
        return _fail("--from committed does not apply to --pop (a pop group keeps its own position)", EXIT_USAGE)
    with _client(args) as c:
        printed = 0
        while not args.max or printed < args.max:
            want = 1000 if not args.max else min(1000, args.max - printed)
            msgs = c.pop(args.group, args.topic, max_messages=want, invisible_ms=args.invisible_ms,
                         max_wait_ms=args.timeout_ms, start=args.start, isolation=args.isolation)
            if not msgs:
                break
            for m in msgs:
                print(json.dumps({**json.loads(_message_json(m)), "delivery_count": m.delivery_count}))
            sys.stdout.flush()
            refused = c.ack(args.group, msgs)
            for handle, why in refused.items():
                print(f"tidemark: not acked ({why}): {handle}", file=sys.stderr)
            printed += len(msgs)
    return 0


def _consume(args: argparse.Namespace) -> int:
    if args.pop and not args.group:
        return _fail("--pop needs --group", EXIT_USAGE)
    if args.pop:
        return _consume_pop(args)
    if args.group:
        return _consume_group(args)
    if args.start == "committed":
        return _fail("--from committed needs --group", EXIT_USAGE)
    with _client(args) as c:
        topics = c.list_topics(include_system=True)
        if args.topic not in topics:
            return _fail(f"NOT_FOUND: unknown topic {args.topic!r}")
        queues = topics[args.topic]["queues"]
        positions: dict[int, int] = {}
        for q in range(queues):
            if args.start == "latest":
                positions[q] = topics[args.topic]["stable_offsets" if args.isolation == "read_committed" else "max_offsets"][q]
            else:
                positions[q] = c.pull(args.topic, q, 0, max_messages=1, isolation=args.isolation).min_offset
        printed = 0
        idle_since = time.monotonic()
        while True:
            got = 0
            for q in range(queues):
                want = 1000 if not args.max else min(1000, args.max - printed)
                if want <= 0:
                    break
                res = c.pull(args.topic, q, positions[q], max_messages=want, max_wait_ms=0, isolation=args.isolation)
                for m in res:
                    print(_message_json(m))
                got += len(res)
                printed += len(res)
                positions[q] = res.next_offset
            if args.max and printed >= args.max:
                break
            if got:
                idle_since = time.monotonic()
            elif (time.monotonic() - idle_since) * 1000 >= args.timeout_ms:
                break
            else:
                time.sleep(0.02)
        sys.stdout.flush()
    return 0


def _rebalance(args: argparse.Namespace) -> int:
    drain = getattr(args, "shard", "")
    cancel = getattr(args, "cancel", False)
    with _client(args) as c:  # a cancelled drain moves nothing back: a rebalance afterwards does
        moves = c.rebalance(undrain=drain, dry_run=args.dry_run) if cancel else c.rebalance(drain=drain, dry_run=args.dry_run)
    failed = [m for m in moves if m["error"]]
    print(json.dumps({"dry_run": args.dry_run, "drain": "" if cancel else drain, "undrain": drain if cancel else "",
                      "moves": moves, "failed": len(failed)}, indent=2))
    return 1 if failed else 0


def _move_slot(args: argparse.Namespace) -> int:
    if (args.slot is None) == (not args.group):
        return _fail("name the slot or --group (one of them)", EXIT_USAGE)
    slot = slot_of(args.group) if args.group else args.slot
    with _client(args) as c:
        shard = c.move_slot(slot, args.to, timeout_ms=args.timeout_ms)
    print(json.dumps({"moved": {"slot": slot, "to": shard}}))
    return 0


def _cluster_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.cluster_status()
    if args.json:
        print(json.dumps(st, indent=2))
    elif not st["sharded"]:
        print("not a cluster of shards: one pair (coordinator.shard is empty); `tidemark status` shows it")
    else:
        print(f"shards: {len(st['shards'])}  etcd revision: {st['revision']}  asked node's shard: {st['shard']}")
        for s in st["shards"]:
            state = " DRAINED" if s["drained"] else " draining" if s["draining"] else ""
            print(f"{s['shard']:16} master={s['master'] or '(none)'} epoch={s['epoch']} queues={s['queues']} "
                  f"slots={s['slots']} read_only_segments={s['read_only_segments']}{state} "
                  f"nodes={','.join(s['nodes']) or '(none)'}")
        for m in st["moves"]:
            what = f"{m['topic']}/{m['queue']}" if m["topic"] else f"group slot {m['queue']}"
            print(f"moving: {what} {m['from']} -> {m['to']}")
    return 0


def _status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.status()
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        for k, v in st.items():
            print(f"{k:24} {json.dumps(v) if isinstance(v, (dict, list)) else v}")
    return 0

