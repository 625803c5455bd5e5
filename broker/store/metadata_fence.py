"""Reads of the metadata view after taking office wait until it applied what was confirmed then."""

from __future__ import annotations

import structlog

from broker.errors import BrokerError
from broker.store.state import StoreState

log = structlog.get_logger("store")


class MetadataFence(StoreState):
    def raise_metadata_fence(self, offset: int) -> None:
        """A node taking office: no call reads the views before they applied up to ``offset``."""
        self.metadata_fence = max(self.metadata_fence, offset)

    def wait_metadata_applied(self, offset: int, timeout_s: float) -> bool:
        """Wait until the metadata view applied everything below ``offset`` (a write is visible)."""
        return self.dispatcher.wait_applied(self.views.metadata, offset, timeout_s)

    async def wait_metadata_applied_async(self, offset: int, timeout_s: float) -> bool:
        """``wait_metadata_applied`` for a coroutine on the server's event loop."""
        return await self.dispatcher.wait_applied_async(self.views.metadata, offset, timeout_s)

    def wait_metadata_fence(self, timeout_s: float) -> None:
        """A read of the metadata view (topics, committed offsets, groups) on a node that took
        office moments ago waits until the view applied what was confirmed then
        (``metadata_fence``): a slave's views apply only what its master confirmed to it, the
        rest once it is master, and a client's first call after a failover must not meet
        "unknown topic", or an older committed offset, for a write acknowledged before it.
        Free once passed. UNAVAILABLE (clients retry) if the view is still behind after
        ``timeout_s``."""
        fence = self.metadata_fence
        if fence:
            self._passed_fence(fence, self.wait_metadata_applied(fence, timeout_s))

    async def wait_metadata_fence_async(self, timeout_s: float) -> None:
        """``wait_metadata_fence`` for a coroutine on the server's event loop."""
        fence = self.metadata_fence
        if fence:
            self._passed_fence(fence, await self.wait_metadata_applied_async(fence, timeout_s))

    def _passed_fence(self, fence: int, applied: bool) -> None:
        if not applied:
            raise BrokerError("UNAVAILABLE", "this node took office moments ago and is still applying its log to "
                              f"its views (up to offset {fence}); retry")
        if self.metadata_fence == fence:
            self.metadata_fence = 0
