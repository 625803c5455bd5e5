"""The store's views (DESIGN §1), opened together; the order is the order they apply a batch in."""

from __future__ import annotations

import os
from dataclasses import dataclass

from broker.config import Config
from broker.timers.view import TimerView
from broker.views import ConsumeQueueView, MetadataView, ProducerStateView, View
from broker.views.pop_leases import PopLeaseView
from broker.views.transactions import TxnView


@dataclass
class ViewSet:
    metadata: MetadataView
    queues: ConsumeQueueView
    producers: ProducerStateView
    timers: TimerView
    pops: PopLeaseView
    txns: TxnView

    @classmethod
    def open(cls, config: Config, data_dir: str, log_min_offset: int = 0) -> ViewSet:
        checkpoints = os.path.join(data_dir, "checkpoints")
        os.makedirs(checkpoints, exist_ok=True)
        return cls(
            metadata=MetadataView(os.path.join(data_dir, "metadata")),
            queues=ConsumeQueueView(os.path.join(data_dir, "cq"), os.path.join(checkpoints, "consume_queue.ckpt")),
            producers=ProducerStateView(os.path.join(checkpoints, "producer_state.ckpt")),
            timers=TimerView(os.path.join(data_dir, "timer"), config),
            pops=PopLeaseView(os.path.join(checkpoints, "pop_leases.ckpt"), log_min_offset),
            txns=TxnView(os.path.join(data_dir, "txn"), log_min_offset),
        )

    @property
    def all(self) -> list[View]:
        return [self.metadata, self.queues, self.producers, self.timers, self.pops, self.txns]

    def applied_min(self) -> int:
        return min(v.applied_offset for v in self.all)

    def applied_max(self) -> int:
        return max(v.applied_offset for v in self.all)

    def close(self) -> None:
        for v in self.all:
            v.close()
