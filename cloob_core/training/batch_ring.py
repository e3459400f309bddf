"""The batches' memory: a ring of step slots in shared memory, which the data-loader workers write each step's
crops and tokens into, and from which the device copies the batch directly (page-locked on a GPU).

Why: the main process of a GPU run launches the step's kernels, and every millisecond of CPU it spends on the data
is a millisecond the GPU may wait. Chunks sent through the DataLoader's queue cost it, per step, a shared-memory
segment per chunk to receive, map and fault in, and a copy of the whole batch into page-locked memory: about 25
to 39 ms of its CPU for 256 images at 224 px (docs/performance.md, "On a GPU"). Here each worker writes its
streams' chunks straight into their place in the step's slot, the chunks it sends carry only positions, and the
batch is a view of the slot: the main process copies nothing, and the host-to-device copy is one DMA from
page-locked memory on a stream of its own.

A slot is written again ``slots`` steps later. Workers wait before writing a step whose slot the main process has
not released; it releases a step's slot when it asks for the next batch, once the step's copy to the device is
done (on a GPU an event of the copy stream, issued a step earlier; on the CPU the step has already read it). So the
step a worker waits for has always been released before the main process waits for that worker: no deadlock.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from cloob_core.errors import StageError

log = logging.getLogger(__name__)
SHARED_MEMORY = "/dev/shm"  # where torch's shared tensors live on Linux
POLL_SECONDS = 0.0005  # a worker waiting for its slot checks this often
PARENT_CHECK_SECONDS = 1.0  # and this often whether its main process still exists


class SharedMemoryTooSmall(StageError):
    """/dev/shm cannot hold the batch ring: a container's default (64 MiB) is far too small for training."""


def _check_shared_memory(needed: int, folder: str = SHARED_MEMORY) -> None:
    """Refuse in one line what would otherwise end the run with SIGBUS when a full /dev/shm is first written."""
    if not os.path.isdir(folder):
        return
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise SharedMemoryTooSmall(
            f"the batch ring needs {needed / 2**20:.0f} MiB of shared memory and {folder} has {free / 2**20:.0f} MiB "
            f"free: give the container more (docker run --shm-size, the pods' cluster.shm) or lower "
            f"train.batch_size per rank")


class BatchRing:
    """``slots`` step slots of ``images`` uint8 crops (``size`` px, channels last) and ``texts`` token rows."""

    def __init__(self, slots: int, images: int, size: int, texts: int, token_row: torch.Tensor,
                 start_step: int = 0) -> None:
        self.slots = slots
        images_shape, tokens_shape = (slots, images, size, size, 3), (slots, texts, *token_row.shape)
        _check_shared_memory(math.prod(images_shape) + math.prod(tokens_shape) * token_row.element_size())
        self.images = torch.empty(images_shape, dtype=torch.uint8).share_memory_()
        self.tokens = torch.empty(tokens_shape, dtype=token_row.dtype).share_memory_()
        self._free_below = multiprocessing.get_context().RawValue("q", start_step + slots)  # steps it may write
        self._main = os.getpid()
        self._pinned: list[int] = []
        self._copy_stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None  # the last batch's copy to the device

    @classmethod
    def for_run(cls, slots: int, streams: int, chunk_size: int, image_views: int, text_views: int, size: int,
                tokenizer: Callable, start_step: int) -> BatchRing:
        """A ring for ``streams`` streams of ``chunk_size`` samples a step; the token row's shape and type are the
        tokenizer's."""
        return cls(slots, streams * chunk_size * image_views, size, streams * chunk_size * text_views,
                   tokenizer(["a"])[0], start_step)

    def write(self, step: int, image_offset: int, views: Sequence[np.ndarray], text_offset: int,
              tokens: torch.Tensor) -> None:
        """In a worker (or the main process, without workers): a chunk's crops and token rows into step ``step``'s
        slot, once the slot is free."""
        self._wait_free(step)
        slot = step % self.slots
        if views:
            np.stack(views, out=self.images[slot, image_offset : image_offset + len(views)].numpy())
        self.tokens[slot, text_offset : text_offset + len(tokens)] = tokens

    def _wait_free(self, step: int) -> None:
        if step < self._free_below.value:
            return
        if os.getpid() == self._main:  # without workers nobody else could release it
            raise RuntimeError(f"step {step}'s batch slot is still in use (released below {self._free_below.value})")
        checked = time.monotonic()
        while step >= self._free_below.value:
            time.sleep(POLL_SECONDS)
            if time.monotonic() - checked > PARENT_CHECK_SECONDS:
                if os.getppid() != self._main:
                    return  # the main process is gone: the DataLoader's watchdog ends this worker
                checked = time.monotonic()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s images ([N, 3, size, size] uint8, channels-last memory) and tokens: views of its slot,
        valid until the step is released."""
        slot = step % self.slots
        return self.images[slot].permute(0, 3, 1, 2), self.tokens[slot]

    def release(self, step: int) -> None:
        """Step ``step`` is done with: its slot may take step ``step + slots`` (after its device copy finished)."""
        if self._copied is not None:
            self._copied.synchronize()  # issued a step ago on its own stream: done, or a DMA away
            self._copied = None
        self._free_below.value = step + 1 + self.slots

    def close(self) -> None:
        """No batch is read any more: waiting workers go on (and the DataLoader ends them)."""
        self._free_below.value = 1 << 62

    def pin(self, device: torch.device) -> None:
        """Page-lock the slots for asynchronous copies to ``device``. Called after the workers are forked: the
        driver may keep a registered range out of a forked child. Where registration fails (a restricted
        container), the copies stay correct and become synchronous."""
        if device.type != "cuda" or self._pinned:
            return
        cudart = torch.cuda.cudart()
        for tensor in (self.images, self.tokens):
            error = int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0))
            if error:
                log.warning("the batch memory could not be page-locked (cudaHostRegister error %d): host-to-device "
                            "copies are synchronous", error)
                return
            self._pinned.append(tensor.data_ptr())
        self._copy_stream = torch.cuda.Stream(device)

    def unpin(self) -> None:
        if self._pinned and self._copied is not None:
            self._copied.synchronize()
        cudart = torch.cuda.cudart() if self._pinned else None
        for pointer in self._pinned:
            cudart.cudaHostUnregister(pointer)
        self._pinned = []

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of a slot's view on ``device``: on a GPU made on the ring's own stream, which the current stream
        then waits for, so the copy overlaps the previous step's kernels."""
        if self._copy_stream is None:  # the CPU, or memory that could not be page-locked: a plain copy
            return tensor.to(device, copy=True)
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(self._copy_stream):
            moved = tensor.to(device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        current.wait_stream(self._copy_stream)
        moved.record_stream(current)
        return moved

    def __getstate__(self) -> dict:
        """To a spawned worker: the shared tensors and the counter; no CUDA state."""
        return {**self.__dict__, "_pinned": [], "_copy_stream": None, "_copied": None}
