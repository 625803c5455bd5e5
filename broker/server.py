"""``tidemark serve``: recover the store, then serve gRPC (+ health, reflection) and metrics."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from concurrent import futures
from importlib.metadata import entry_points
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from broker import alloc, metrics
from broker.config import Config
from broker.invariant import StartupRefused
from broker.service import BrokerService
from broker.store import Store
from broker.wire import add_broker_service
from proto import tidemark_pb2 as pb

log = structlog.get_logger("server")
GRACE_S = 5.0


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.store = Store(config, config["node.data_dir"])
        self.grpc_server: grpc.Server | None = None
        self.health = health.HealthServicer()
        self.stopping = threading.Event()
        self.on_start: list[Callable[[], None]] = []  # plugins: run once serving
        self.on_stop: list[Callable[[], None]] = []  # plugins: run before the store stops

    def start(self) -> None:
        log.info("starting", data_dir=self.config["node.data_dir"], listen=self.config["node.listen"])
        self.store.start()
        limit = self.config["limits.request_bytes_max"]
        # a pull answers up to pull_bytes_max of batches, or one batch of up to request_bytes_max
        send_limit = max(limit, self.config["limits.pull_bytes_max"]) + (1 << 20)
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", send_limit),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.config["limits.grpc_workers"]), options=options)
        self.grpc_server = server
        add_broker_service(BrokerService(self.store), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = [s.full_name for s in pb.DESCRIPTOR.services_by_name.values()] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
        for plugin in entry_points(group="tidemark.plugins"):
            plugin.load()(self)
            log.info("plugin_attached", plugin=plugin.name)
        if server.add_insecure_port(self.config["node.listen"]) == 0:
            raise StartupRefused(f"node.listen: cannot bind {self.config['node.listen']}")
        server.start()
        for hook in self.on_start:
            hook()
        if self.config["node.metrics_listen"]:
            host, _, port = self.config["node.metrics_listen"].rpartition(":")
            start_http_server(int(port), addr=host, registry=metrics.REGISTRY)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("tidemark.v1.Broker", health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._lag_metrics_loop, name="lag-metrics", daemon=True).start()
        log.info("serving", listen=self.config["node.listen"], role=self.store.role,
                 recovery=self.store.recovery_report)

    def _lag_metrics_loop(self) -> None:
        while not self.stopping.wait(5.0):
            try:
                for group, topic, queue, offset in self.store.metadata.group_offsets():
                    qf = self.store.consume_queues.queue(topic, queue)
                    if qf is not None:
                        metrics.GROUP_LAG.labels(group, topic, str(queue)).set(qf.next_queue_offset - offset)
                metrics.SEGMENTS.set(len(self.store.log.segments))
                self.store.free_bytes()
            except Exception as exc:
                log.warning("lag_metrics_failed", error=str(exc))

    def stop(self) -> None:
        """Graceful: refuse new calls, drain in-flight ones, then stop the store cleanly."""
        log.info("stopping")
        self.stopping.set()
        self.health.enter_graceful_shutdown()
        self.store.begin_close()  # new writes get UNAVAILABLE; in-flight acks still complete
        for hook in self.on_stop:
            hook()
        if self.grpc_server is not None:
            self.grpc_server.stop(GRACE_S).wait()
        self.store.stop()
        log.info("stopped", clean=True)


def serve(config: Config) -> int:
    alloc.tune()
    daemon = Daemon(config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon.start()
    while not stop.wait(1.0):
        pass
    daemon.stop()
    return 0
