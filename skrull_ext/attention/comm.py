"""Ring point-to-point communication over a CP group.

Each exchange sends one tensor to the next rank of the ring and receives a tensor of the
same shape and dtype from the previous one (``torch.distributed.batch_isend_irecv``).
Exchanges are grouped in *channels* (forward K/V, backward K/V, backward dK/dV); each
channel has its own message tag and pending requests, and the backward channels may use
a separate process group, so forward and backward messages can never be matched with
each other.  The object is replaceable: anything with :meth:`send_recv_async`,
:meth:`wait`, ``rank`` and ``size`` works (tests use a recording wrapper).

gloo cannot send CUDA tensors, and two processes sharing one GPU cannot share an NCCL
communicator; so on a gloo group the exchanges of CUDA tensors are *staged through host
memory*: copied to pinned host buffers when posted (a blocking copy, so the GPU work that
produced them is done), sent by gloo, and copied back to the device in :meth:`wait`, on
the stream current there.  That is for function (the one-GPU CP checks of
``tools/check_gpu.py``), not speed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

#: Channel names used by the DACP attention and their tag offsets.
CHANNELS = {"fwd_kv": 0, "bwd_kv": 1, "bwd_dkv": 2}


class RingComm:
    """Send-to-next / receive-from-previous exchanges on a CP process group.

    Args:
        group: The CP process group (ranks in group order form the ring).
        bwd_group: Optional separate group for the backward channels (e.g. a second
            NCCL communicator so backward traffic runs on its own stream).
        tag_base: Added to the channel tags (to separate several concurrent users).
        members: Ranks of ``group`` (group order) forming the ring; default all of them.
            This rank must be one of them.
        host_staging: Stage exchanges through host memory; None (default): for non-CPU
            tensors on a gloo group.  True stages CPU tensors too (tests).

    Attributes:
        rank: This rank's index in the ring (``members``).
        size: Ring size.
        bytes_sent: Bytes this rank has sent so far (all channels).
        messages_sent: Number of messages sent so far.
    """

    def __init__(self, group, *, bwd_group=None, tag_base: int = 0, members=None,
                 host_staging=None):
        self.group = group
        self.bwd_group = bwd_group if bwd_group is not None else group
        group_size = dist.get_world_size(group)
        self.members = tuple(range(group_size)) if members is None else tuple(members)
        self.rank = self.members.index(dist.get_rank(group))
        self.size = len(self.members)
        if bwd_group is not None and dist.get_world_size(bwd_group) != group_size:
            raise ValueError("bwd_group must contain the same ranks as group")
        self.tag_base = int(tag_base)
        self.host_staging = host_staging  # as given, for subgroup()
        self._stage_cpu = host_staging is True
        self._stage_device = self._stage_cpu or (host_staging is None
                                                 and dist.get_backend(group) == "gloo")
        self.bytes_sent = 0
        self.messages_sent = 0
        self._pending: dict[str, list] = {}

    def _peer(self, group, offset: int) -> int:
        return dist.get_global_rank(group, self.members[(self.rank + offset) % self.size])

    def subgroup(self, first: int, size: int) -> "RingComm":
        """The ring of CP ranks ``first .. first + size - 1`` (this rank among them).

        Same process groups, explicit peers; its tags (``tag_base + 3 (1 + first + N
        size)``) differ from the full ring's and every other sub-group's, so a message
        can only match its own ring even if rings of one rank were ever in flight together.
        """
        tag = self.tag_base + len(CHANNELS) * (1 + first + len(self.members) * size)
        return RingComm(self.group, bwd_group=self.bwd_group, tag_base=tag,
                        members=self.members[first:first + size],
                        host_staging=self.host_staging)

    def warm_up(self, device="cpu") -> list[int]:
        """One exchange around the full ring on each of its process groups, every rank at
        once; call it on every CP rank before the first attention.

        NCCL requires the first ``batch_isend_irecv`` on a group to involve all of the
        group's ranks; a plan whose first micro-batch holds only CP sub-group rings would
        otherwise make a sub-ring the group's first P2P call.  Harmless on gloo.

        Args:
            device: Where the one-element messages live (the CUDA device under NCCL).

        Returns:
            Per process group (the forward one, then the backward one if separate), the
            ring position this rank heard from (its predecessor's).
        """
        if self.size != dist.get_world_size(self.group):
            raise ValueError("warm_up runs on the full ring, not on a sub-group")
        channels = ["fwd_kv"] if self.bwd_group is self.group else ["fwd_kv", "bwd_kv"]
        heard = []
        for channel in channels:
            mine = torch.full((1,), float(self.rank), dtype=torch.float32, device=device)
            recv = self.send_recv_async(mine, channel=channel)
            self.wait(channel)
            heard.append(int(recv.item()))
        return heard

    def send_recv_async(self, send: torch.Tensor, *, channel: str = "fwd_kv") -> torch.Tensor:
        """Posts sending ``send`` to the next rank and receiving from the previous one.

        Args:
            send: Tensor to send (made contiguous; kept alive until :meth:`wait`).
            channel: One of :data:`CHANNELS`; at most one exchange pending per channel.

        Returns:
            The receive buffer (same shape/dtype as ``send``); valid after :meth:`wait`.
        """
        if channel not in CHANNELS:
            raise ValueError(f"unknown channel {channel!r}; use one of {list(CHANNELS)}")
        if self._pending.get(channel):
            raise RuntimeError(f"channel {channel!r} already has an exchange in flight; wait() first")
        send = send.contiguous()
        recv = torch.empty_like(send)
        wire_send, wire_recv = send, recv
        if self._stage_cpu or (self._stage_device and send.device.type != "cpu"):
            pin = send.device.type == "cuda"
            wire_send = torch.empty(send.shape, dtype=send.dtype, pin_memory=pin)
            wire_send.copy_(send)  # blocking: waits for the work that produced ``send``
            wire_recv = torch.empty(send.shape, dtype=send.dtype, pin_memory=pin)
        group = self.group if channel == "fwd_kv" else self.bwd_group
        tag = self.tag_base + CHANNELS[channel]
        ops = [
            dist.P2POp(dist.isend, wire_send, self._peer(group, 1), group, tag),
            dist.P2POp(dist.irecv, wire_recv, self._peer(group, -1), group, tag),
        ]
        reqs = dist.batch_isend_irecv(ops)
        self._pending[channel] = [reqs, wire_send, wire_recv, recv]
        self.bytes_sent += send.numel() * send.element_size()
        self.messages_sent += 1
        return recv

    def wait(self, channel: str = "fwd_kv") -> None:
        """Blocks until the pending exchange of ``channel`` has completed (no-op if none)."""
        entry = self._pending.pop(channel, None)
        if entry:
            for req in entry[0]:
                req.wait()
            wire_recv, recv = entry[2], entry[3]
            if wire_recv is not recv:  # staged: to the device, on the current stream
                recv.copy_(wire_recv, non_blocking=True)
