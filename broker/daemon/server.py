"""``tidemark serve``: recover the store, then serve gRPC (+ health, reflection) and metrics.

Under systemd (``Type=notify``, deploy/systemd/) the daemon reports its state with sd_notify:
``STATUS=`` lines while it starts, ``READY=1`` once recovery is done and the gRPC port serves,
``WATCHDOG=1`` from the main loop while the flusher makes progress, ``RELOADING=1`` … ``READY=1``
around a SIGHUP reload of the reloadable keys, ``STOPPING=1`` on SIGTERM before the graceful stop.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import structlog
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from broker import alloc, clock, gcpause, metrics
from broker.config import KEYS, Config, ConfigError, insecure_exposures, missing_extras
from broker.daemon import logsetup, metrics_http, plain, plugins, reflection
from broker.daemon.aioloop import LoopThread
from broker.daemon.bridge import BridgedServicer
from broker.daemon.heartbeats import Heartbeats
from broker.daemon.liveness import FlushProgress
from broker.daemon.longpoll import LongPolls
from broker.daemon.sdnotify import Notifier
from broker.daemon.service import FENCE_EXEMPT, BrokerService
from broker.daemon.wire import add_broker_service
from broker.invariant import StartupRefused
from broker.logformat import batch as bf
from broker.security import auth, tls
from broker.storage import quarantine
from broker.storage.dirlock import LOCK_NAME, DirLock
from broker.storage.handles import HANDLES
from broker.storage.regular import NotRegularFile
from broker.store import Store
from broker.threads import NamedThread, name_pool_thread
from proto import tidemark_pb2 as pb

log = structlog.get_logger("server")
GRACE_S = 5.0
STREAMS_MAX = 32  # blocking streams served at once (slaves and snapshot downloads)
ENDS_WORKERS = 8  # combined ack runs at once (one per group at most: broker/daemon/combine.py)
PENDING_CALLS_MAX = 50_000  # calls gRPC core holds for the server before it refuses new ones
FD_RESERVE = 256  # descriptors beyond limits.open_files_max: client sockets, LMDB, logs, the lock
SOCKETS_WANTED = 65536  # the soft RLIMIT_NOFILE is raised this far above the files when the hard limit allows
MAIN_LOOP_S = 1.0  # the main loop wakes at least this often (more often for the watchdog)
UMASK = 0o077  # files and directories the daemon creates are private to its user


class Daemon:
    store: Store  # recovered by start(), before plugins attach

    def __init__(self, config: Config, notifier: Notifier | None = None) -> None:
        self.config = config
        self.notifier = notifier or Notifier({})
        self.authorizer, self.tokens = auth.authorizer(config)
        _warn_if_open(config["node.data_dir"])
        self.grpc_server: grpc.aio.Server | None = None
        self.aio = LoopThread()
        self.health = health_async.HealthServicer()
        self.longpolls = LongPolls(self.aio.loop, lambda: self.config["limits.parked_waits_max"])
        self.read_pool = futures.ThreadPoolExecutor(max_workers=config["limits.grpc_workers"], thread_name_prefix="pull",
                                                    initializer=name_pool_thread)
        # combined acks of pop leases, each waiting for its record (not in the pull pool: slow replicas
        # would hold its threads; the server's own pool ran acks before they were combined)
        self.ends_pool = futures.ThreadPoolExecutor(max_workers=ENDS_WORKERS, thread_name_prefix="ends",
                                                    initializer=name_pool_thread)
        # one thread per long-lived blocking stream (replication to a slave, a snapshot download)
        self.stream_pool = futures.ThreadPoolExecutor(max_workers=STREAMS_MAX, thread_name_prefix="stream", initializer=name_pool_thread)
        self.stopping = threading.Event()
        self.on_start: list[Callable[[], None]] = []  # plugins: run once serving
        self.on_stop: list[Callable[[], None]] = []  # plugins: run before the store stops

    def start(self) -> None:
        log.info("starting", data_dir=self.config["node.data_dir"], listen=self.config["node.listen"],
                 tls=bool(self.config["tls.cert_file"]), tokens=self.tokens.names() if self.tokens else [])
        exposed = insecure_exposures(self.config.as_dict())
        metrics.INSECURE_NETWORK.set(1 if exposed else 0)
        if exposed:
            log.warning("insecure_network", keys=exposed, note="serving a non-loopback address without TLS or tokens "
                        "(security.insecure_network = true): anyone who reaches the port can write and read")
        self.notifier.status(f"recovering {self.config['node.data_dir']}")
        bound_open_files(self.config["limits.open_files_max"])
        with gcpause.paused():  # recovery's objects live for good: no collection walks them
            self.store = Store.open(self.config)
        gcpause.tune_for_serving()
        self.store.start()
        self.notifier.status("recovered; starting the gRPC server")
        limit = self.config["limits.request_bytes_max"]
        # a pull answers up to pull_bytes_max of batches, or one batch of up to request_bytes_max;
        # the largest pull_bytes_max a SIGHUP may set counts, since the server's limit is fixed
        send_limit = max(limit, KEYS["limits.pull_bytes_max"].maximum or 0) + (1 << 20)
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", send_limit),
            ("grpc.so_reuseport", 0),
            # calls received but not yet taken by the asyncio server: beyond gRPC's default soft limit
            # (1,000) a burst of new long-polls made unrelated calls fail CANCELLED; still bounded
            ("grpc.server.max_pending_requests", PENDING_CALLS_MAX),
            ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS_MAX),
            # clients ping every 500 ms to notice a silent node within about 1 s (DESIGN §11)
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 400),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        server = self.aio.call(self._make_server(options))
        self.grpc_server = server
        self.store.register_queue_listener(self.longpolls.notify_threadsafe)
        self.heartbeats = Heartbeats(self.aio.loop, self._queue_count,
                                     members_max=self.config["groups.members_max"],
                                     rejoin_grace_ms=self.config["groups.rejoin_grace_ms"],
                                     groups_max=self.config["groups.live_groups_max"],
                                     members_total_max=self.config["groups.members_total_max"])
        self.heartbeats.role_changed_threadsafe(self.store.role)
        self.store.register_role_listener(self.heartbeats.role_changed_threadsafe)
        self.heartbeats.start()
        self.service = BrokerService(self.store, self.longpolls, self.read_pool, self.heartbeats, self.ends_pool)
        add_broker_service(self.service, server, FENCE_EXEMPT)
        self.service.start()
        self.on_stop.append(self.service.stop)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable(server, [s.full_name for s in pb.DESCRIPTOR.services_by_name.values()] + [health.SERVICE_NAME])
        host: plugins.PluginHost = self  # (mypy checks the daemon is what plugins are promised)
        for name, attach in plugins.load(plugins.PLUGINS):
            attach(host)
            log.info("plugin_attached", plugin=name)
        tls.listen_on(server, "node.listen", self.config["node.listen"], tls.client_port_credentials(self.config))
        self.aio.call(server.start())
        for hook in self.on_start:
            hook()
        if self.config["node.metrics_listen"]:
            metrics.QUARANTINE_BYTES.set(quarantine.kept_bytes(self.config["node.data_dir"]))  # what recovery just kept
            self._serve_metrics()
        self.aio.call(self.health.set("", health_pb2.HealthCheckResponse.SERVING))
        self.aio.call(self.health.set("tidemark.v1.Broker", health_pb2.HealthCheckResponse.SERVING))
        NamedThread(target=self._lag_metrics_loop, name="lag-metrics", daemon=True).start()
        log.info("serving", listen=self.config["node.listen"], role=self.store.role,
                 recovery=self.store.recovery_report)
        if not bf.NATIVE_FRAMING:
            log.warning("native_framing_missing", note="broker.logformat._framing was not built or failed to import: "
                        "sends walk their record framing in Python, about 100 times slower per record")
        if plain.native is None:
            log.warning("native_framing_missing", note="broker.logformat._plainwire was not built or failed to import: "
                        "plain messages are framed and decoded pulls built in Python, about 15 times slower")
        self.store.register_role_listener(self._on_role_change)
        self.store.register_status_provider(self._security_status)
        self.store.register_status_provider(self._resources_status)
        self.notifier.ready(self.serving_status())

    def add_blocking_servicer(self, add: Callable[[Any, Any], None], servicer: Any, streams: dict[str, bool]) -> None:
        """Register a servicer written with blocking generators (``streams``: method name → whether
        its requests are a stream too) on the asyncio server, through ``bridge.BridgedServicer``."""
        add(BridgedServicer(servicer, streams, self.stream_pool), self.grpc_server)

    async def _make_server(self, options: list[tuple[str, Any]]) -> grpc.aio.Server:
        """The asyncio server, made on its loop: coroutine handlers (Pull) run on the loop, plain
        ones in a pool of ``limits.grpc_workers`` threads."""
        pool = futures.ThreadPoolExecutor(max_workers=self.config["limits.grpc_workers"], thread_name_prefix="grpc",
                                          initializer=name_pool_thread)
        return grpc.aio.server(migration_thread_pool=pool, options=options,
                               interceptors=[auth.AsyncAuthInterceptor(self.authorizer)])

    def _queue_count(self, topic: str) -> int | None:
        """A topic's queues (over every shard in a cluster of shards: a group spans them)."""
        if self.store.placement is not None and (n := self.store.placement.queue_count(topic)) is not None:
            return n
        info = self.store.views.metadata.topic(topic)
        return int(info["queues"]) if info is not None else None

    def _resources_status(self, st: dict[str, object]) -> None:
        st["long_polls"] = self.longpolls.parked
        st["open_files"] = {"open": HANDLES.open_count, "max": HANDLES.limit}
        st["native_framing"] = bf.NATIVE_FRAMING and plain.native is not None

    def _serve_metrics(self) -> None:
        """``node.metrics_listen``: Prometheus's endpoint, with TLS and a token if configured."""
        c = self.config
        host, _, port = c["node.metrics_listen"].rpartition(":")
        try:
            tls_ctx = metrics_http.tls_context(c["tls.cert_file"], c["tls.key_file"], c["tls.client_ca_file"]) \
                if c["node.metrics_tls"] else None
        except (OSError, ssl.SSLError) as exc:
            raise StartupRefused(f"node.metrics_tls: cannot load {c['tls.cert_file']}: {exc}") from None
        authorize = None
        if c["node.metrics_auth"]:
            tokens = self.tokens

            def roles_of(secret: str) -> frozenset[str] | None:
                token = tokens.find(secret) if tokens is not None else None
                return token.roles if token is not None else None

            authorize = metrics_http.bearer_check(roles_of)
        try:
            metrics_http.serve(host, int(port), metrics.REGISTRY, tls=tls_ctx, authorize=authorize)
        except OSError as exc:
            raise StartupRefused(f"node.metrics_listen: cannot listen on {host}:{port}: {exc.strerror}") from None

    def _security_status(self, st: dict[str, object]) -> None:
        c = self.config
        st["security"] = {"tls": bool(c["tls.cert_file"]), "client_certificates": bool(c["tls.client_ca_file"]),
                          "replication_mutual_tls": bool(c["replication.tls_cert_file"]),
                          "token_for_writes": self.tokens is not None,
                          "token_for_reads": self.tokens is not None and c["auth.require_for_reads"],
                          "tokens": self.tokens.names() if self.tokens is not None else [],
                          "insecure_network": insecure_exposures(c.as_dict())}

    def _on_role_change(self, _role: str) -> None:
        self.notifier.status(self.serving_status())

    def serving_status(self) -> str:
        r = self.store.recovery_report
        start = "new data directory" if r.get("new") else (
            "clean start" if r.get("clean") else f"recovered, replayed {r.get('replayed_bytes', 0)} bytes")
        return (f"serving {self.config['node.listen']} as {self.store.role}, epoch {self.store.epoch}; "
                f"{start} in {r.get('seconds', 0)} s")

    def reload(self, load: Callable[[], Config]) -> bool:
        """SIGHUP: take the reloadable keys from the file (+ environment), or keep everything."""
        self.notifier.reloading()
        try:
            new = load()
            changed = self.config.differences(new)
            fixed = sorted(k for k in changed if not KEYS[k].reloadable)
            if fixed:
                raise ConfigError(f"{', '.join(fixed)}: changed, but {'this key needs' if len(fixed) == 1 else 'these keys need'}"
                                  " a restart to take effect")
            tokens = auth.load_tokens(new) if self.tokens is not None else None
        except ConfigError as exc:
            log.error("reload_refused", error=str(exc), note="the running configuration is unchanged")
            metrics.CONFIG_RELOADS.labels("refused").inc()
            self.notifier.ready(f"reload refused: {exc}; {self.serving_status()}")
            return False
        self.config.update_reloadable(new)
        metrics.CONFIG_RELOADS.labels("applied").inc()
        rotated = self.tokens.replace(tokens) if self.tokens is not None and tokens else False
        # logged before a new log level applies, so that raising it still records the reload
        log.info("reloaded", changed={k: {"old": old, "new": value} for k, (old, value) in changed.items()},
                 token_rotated=rotated)
        if "log.level" in changed:
            logsetup.configure(self.config["log.level"], self.config["log.format"])
        self.notifier.ready(f"reloaded ({len(changed)} changed); {self.serving_status()}")
        return True

    def _lag_metrics_loop(self) -> None:
        while not self.stopping.wait(5.0):
            self.service.instance.ensure()  # the token file a full disk kept from being written at start
            try:
                lag: dict[tuple[str, ...], float] = {}
                placement = self.store.placement
                for group, topic, queue, offset in self.store.views.metadata.group_offsets():
                    if placement is not None and not placement.coordinates(group):
                        continue  # its slot moved away: the shard coordinating it measures it
                    qf = self.store.views.queues.queue(topic, queue)
                    if qf is not None:  # to the LSO: what a read_committed member can read
                        end = self.store.reads.stable_end(topic, queue, qf.next_queue_offset, True)
                        lag[(group, topic)] = lag.get((group, topic), 0) + max(0, end - offset)
                for group in self.service.pops.groups():  # pop groups: what is not acked yet
                    for (topic, _), info in self.service.pops.describe(group)["queues"].items():
                        lag[(group, topic)] = lag.get((group, topic), 0) + info["lag"]
                metrics.set_bounded(metrics.GROUP_LAG, lag)
                self._lso_metrics()
                metrics.POP_IN_FLIGHT.set(self.service.pops.in_flight_total())
                metrics.SEGMENTS.set(len(self.store.log.segments))
                metrics.QUARANTINE_BYTES.set(quarantine.kept_bytes(self.config["node.data_dir"]))
                metrics.export_status(self.store.status())  # also refreshes replica lag and free disk
            except Exception as exc:
                self.store.incidents.record("metrics", f"{type(exc).__name__}: {exc}")
            else:
                self.store.incidents.clear("metrics")

    def _lso_metrics(self) -> None:
        def end_of(key: tuple[str, int]) -> int | None:
            qf = self.store.views.queues.queue(*key)
            return None if qf is None else qf.next_queue_offset

        lso_lag, stalled_s = self.store.views.txns.lso_report(end_of, clock.wall_ms())
        metrics.set_bounded(metrics.LSO_LAG, {(t,): float(v) for t, v in lso_lag.items()})
        metrics.LSO_STALLED_SECONDS.set(stalled_s)

    def stop(self) -> None:
        """Graceful: refuse new calls, drain in-flight ones, then stop the store cleanly."""
        log.info("stopping")
        self.stopping.set()
        self.aio.call(self.health.enter_graceful_shutdown())
        self.store.begin_close()  # new writes get UNAVAILABLE; in-flight acks still complete
        self.longpolls.notify_threadsafe(None)  # parked pulls answer now
        self.heartbeats.close()  # parked heartbeats too
        for hook in self.on_stop:
            hook()
        if self.grpc_server is not None:
            self.aio.call(self.grpc_server.stop(GRACE_S))
        self.aio.close()
        self.read_pool.shutdown(wait=False)
        self.ends_pool.shutdown(wait=False)
        self.stream_pool.shutdown(wait=False)
        self.store.stop()
        log.info("stopped", clean=True)


def _warn_if_open(data_dir: str) -> None:
    try:
        mode = os.stat(data_dir).st_mode
    except OSError:
        return  # created below with mode 0700
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("data_dir_not_private", data_dir=data_dir, mode=oct(stat.S_IMODE(mode)),
                    note="other users can read it; chmod 700 is recommended")


class _Signals:
    """What the signal handlers asked for; the main loop acts on it (never inside a handler)."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.stop = False
        self.reload = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        log.info("signal", signal=signal.Signals(signum).name)
        if signum == signal.SIGHUP:
            self.reload = True
        else:
            self.stop = True
        self.wake.set()


def bound_open_files(limit: int) -> int:
    """Size the set of open segment and queue files to ``limit``, with ``FD_RESERVE`` descriptors
    left for sockets, LMDB and logs: raise the soft RLIMIT_NOFILE if needed (and allowed), else use
    less and say so. Returns the limit in force."""
    want = limit + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < max(want, SOCKETS_WANTED):
        # room for the files, and for many client sockets beyond them (each long-poll's connection)
        goal = max(want, SOCKETS_WANTED + limit)
        new_soft = goal if hard == resource.RLIM_INFINITY else min(goal, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    effective = limit
    if soft != resource.RLIM_INFINITY and soft < want:
        effective = max(16, soft - FD_RESERVE)
        log.warning("open_files_limited", configured=limit, effective=effective, rlimit_nofile=soft,
                    note="raise LimitNOFILE (systemd) or ulimit -n")
    HANDLES.set_limit(effective)
    return effective


def check_ports(config: Config) -> None:
    """Every port we will listen on is free (one clear line now, not a traceback after recovery)."""
    for key in ("node.listen", "replication.listen", "node.metrics_listen"):
        address = config[key]
        if not address:
            continue
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no obstacle
                s.bind((host, int(port)))
                s.listen(1)
        except OSError as exc:
            raise StartupRefused(f"{key}: cannot listen on {address}: {exc.strerror}") from None


def _still_locked(lock: DirLock, data_dir: str) -> DirLock:
    """The lock on ``data_dir`` itself: a bootstrap may have moved the locked directory aside."""
    try:
        same = os.fstat(lock.fd).st_ino == os.stat(os.path.join(data_dir, LOCK_NAME)).st_ino
    except OSError:
        same = False
    if same:
        return lock
    lock.release()
    return DirLock.acquire(data_dir)


def _keepalive(notifier: Notifier, done: threading.Event) -> None:
    """Watchdog pings while start-up runs (a re-exec for bootstrap happens with the watchdog armed)."""
    interval = notifier.watchdog_interval_s()
    if interval is None:
        return

    def run() -> None:
        while not done.wait(interval):
            notifier.watchdog()

    NamedThread(target=run, name="start-keepalive", daemon=True).start()


def serve(config: Config, load_config: Callable[[], Config] | None = None,
          prestart: Callable[[Config, DirLock], None] | None = None) -> int:
    """Run the daemon until SIGTERM/SIGINT; SIGHUP reloads from ``load_config``."""
    os.umask(UMASK)
    alloc.tune()
    notifier = Notifier()
    signals = _Signals()
    signals.install()
    tls.check_files(config)  # a bad certificate or token file fails before the data directory is touched
    if missing := missing_extras(config):  # an extra the configuration needs: before anything logs
        raise StartupRefused(missing[0])
    auth.load_tokens(config)
    check_ports(config)
    lock = DirLock.acquire(config["node.data_dir"])  # one daemon per directory, before anything reads it
    started = threading.Event()
    _keepalive(notifier, started)
    if prestart is not None:
        notifier.status(f"preparing {config['node.data_dir']}")
        prestart(config, lock)
        lock = _still_locked(lock, config["node.data_dir"])
    daemon = Daemon(config, notifier)
    try:
        daemon.start()
    except NotRegularFile as exc:  # a FIFO or a symlink where a data-directory file belongs
        raise StartupRefused(str(exc)) from None
    finally:
        started.set()
    interval_s = min(MAIN_LOOP_S, notifier.watchdog_interval_s() or MAIN_LOOP_S)
    progress = FlushProgress(stall_s=max(1.0, notifier.watchdog_usec / 1e6))
    unhealthy = False
    while not signals.stop:
        signals.wake.wait(interval_s)
        signals.wake.clear()
        if signals.stop:
            break
        if signals.reload:
            signals.reload = False
            if load_config is not None:
                daemon.reload(load_config)
        if notifier.watchdog_usec:
            reason = progress.check(daemon.store.log.max_offset, daemon.store.watermarks.flushed_offset, time.monotonic())
            if reason is None:
                if unhealthy:
                    log.info("watchdog_resumed")
                    notifier.status(daemon.serving_status())
                notifier.watchdog()
            elif not unhealthy:  # once per episode: systemd restarts us after WatchdogSec without pings
                log.error("watchdog_withheld", reason=reason)
                notifier.status(f"unhealthy: {reason}")
            unhealthy = reason is not None
    notifier.stopping("stopping: draining requests, fsync, checkpointing views")
    daemon.stop()
    notifier.close()
    return 0
