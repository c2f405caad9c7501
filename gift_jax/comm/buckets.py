"""Static packing of gradient pytrees into a few flat, row-structured buckets.

A step should issue a handful of large collectives, not one per leaf. Leaves that share a
codec are concatenated, in tree order, into buckets of at most ``bucket_elems`` elements
(a leaf larger than that gets a bucket of its own). Inside a bucket every leaf starts on a
fresh row of ``codec.row_size`` elements and is zero-padded to whole rows, so that a per-block
scale never mixes two leaves (a tiny norm gain sharing a block with a large matrix would be
flushed to zero); the bucket is then padded with zero rows to a multiple of the number of
replicas, so that it splits into equal shards. The plan depends only on shapes and is built
at trace time.

A leaf that stacks ``g`` separate tensors along its leading axes (the layers of a scanned
model, ``(layers, in, out)``) is packed as ``g`` slots, each starting on a fresh row: every
tensor of the stack gets its own scales, as it would unstacked, so a small layer is not
quantized on the scale of the largest one. The slots of a leaf stay in one bucket.

A per-tensor 8-bit codec packs bytes instead of floats (:meth:`Bucket.pack_bytes`): each
leaf's codes, made where the leaf lies (a :class:`Run` of its slots), in the very places its
floats would have taken; :meth:`Bucket.run_bytes` takes them back out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gift_jax.comm.codecs import Codec

#: Default bucket capacity in elements (64 MiB of fp32).
DEFAULT_BUCKET_ELEMS = 1 << 24


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one leaf lives in its bucket."""

    leaf: int  # index in the flattened pytree
    shape: tuple[int, ...]  # the leaf's
    row_offset: int
    rows: int
    part: int = 0  # which tensor of a stacked leaf (see the module doc)
    parts: int = 1  # how many tensors the leaf stacks

    @property
    def size(self) -> int:
        """Elements of this slot (one tensor of the stack)."""
        return int(np.prod(self.shape, dtype=np.int64)) // self.parts


@dataclasses.dataclass(frozen=True)
class Run(Slot):
    """The slots of one leaf in a bucket, described by its first (``part`` 0): its ``parts``
    stacked tensors (1 unstacked), each on ``rows`` rows, from ``row_offset`` on; they are
    the bucket's slots ``first … first + parts − 1``."""

    first: int = 0  # index of the leaf's first slot in the bucket

    @property
    def inner(self) -> tuple[int, ...]:
        """One tensor's shape: the leaf's without the leading axes that stack the
        ``parts`` tensors (the whole shape unstacked; flat if no leading axes multiply to
        ``parts``)."""
        k, n = 0, 1
        while n < self.parts:
            n *= self.shape[k]
            k += 1
        return tuple(self.shape[k:]) if n == self.parts else (self.size,)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """A flat ``[rows, codec.row_size]`` buffer holding several leaves."""

    codec: Codec
    slots: tuple[Slot, ...]
    rows: int  # multiple of the replica count

    @property
    def num_leaves(self) -> int:
        """Scale groups: one per slot (a leaf, or one tensor of a stacked leaf)."""
        return len(self.slots)

    def row_leaf_ids(self) -> np.ndarray:
        """``int32[rows]``: bucket-local slot id of every row (padding rows: the last slot);
        every slot has its own scales."""
        ids = np.full((self.rows,), max(self.num_leaves - 1, 0), np.int32)
        for i, s in enumerate(self.slots):
            ids[s.row_offset : s.row_offset + s.rows] = i
        return ids

    def pack(self, leaves: list[jax.Array]) -> jax.Array:
        """The bucket's leaves (float32) → ``f32[rows, row_size]``.

        Args:
          leaves: every leaf of the flattened pytree, indexed by :attr:`Slot.leaf` (leaves of
            other buckets are ignored); any float dtype, each of its slot's shape.

        Returns:
          The packed buffer: each slot's tensor flattened from its :attr:`Slot.row_offset`,
          zero-padded to whole rows, then zero rows up to :attr:`rows`.
        """
        return self._pack([leaves[s.leaf].astype(jnp.float32).reshape(s.parts, -1)[s.part]
                           for s in self.slots], jnp.float32)

    def pack_bytes(self, codes: list[jax.Array]) -> jax.Array:
        """One byte per element, leaf by leaf → ``u8[rows, row_size]``, laid out as
        :meth:`pack` lays out the floats (the bytes of an 8-bit codec's rows).

        Args:
          codes: per run (:meth:`runs`, in order), its tensors' codes ``uint8[parts, ...]``
            (:meth:`tensors`' shape).

        Returns:
          The packed bytes.
        """
        B = self.codec.row_size
        flats = []
        for run, c in zip(self.runs(), codes, strict=True):
            c = c.reshape(run.parts, run.size)
            flats.append(jnp.pad(c, ((0, 0), (0, run.rows * B - run.size))).reshape(-1))
        return self._concat(flats, jnp.uint8)

    def _pack(self, flats: list[jax.Array], dtype) -> jax.Array:
        B = self.codec.row_size
        return self._concat([jnp.pad(flat, (0, s.rows * B - s.size))
                             for s, flat in zip(self.slots, flats, strict=True)], dtype)

    def _concat(self, padded: list[jax.Array], dtype) -> jax.Array:
        """Whole rows of the slots, in order → the bucket, zero rows added up to :attr:`rows`."""
        B = self.codec.row_size
        used = sum(s.rows for s in self.slots)
        return jnp.concatenate([*padded, jnp.zeros(((self.rows - used) * B,), dtype)]
                               ).reshape(self.rows, B)

    def unpack(self, buf: jax.Array) -> dict[int, jax.Array]:
        """``f32[rows, row_size]`` → ``{leaf index: f32 array of the leaf's shape}``.

        Args:
          buf: a buffer laid out as :meth:`pack` makes it (``f32[rows, row_size]``, or any
            array of ``rows · row_size`` elements).

        Returns:
          ``{leaf index: array}`` for the leaves of this bucket only, each in its full shape
          (the slots of a stacked leaf concatenated back), padding dropped.
        """
        flat = buf.reshape(-1)
        B = self.codec.row_size
        pieces: dict[int, list[jax.Array]] = {}
        for s in self.slots:
            pieces.setdefault(s.leaf, []).append(
                flat[s.row_offset * B : s.row_offset * B + s.size])
        shapes = {s.leaf: s.shape for s in self.slots}
        return {leaf: (p[0] if len(p) == 1 else jnp.concatenate(p)).reshape(shapes[leaf])
                for leaf, p in pieces.items()}

    # ---- a leaf's tensors where they lie (the byte-packing path of the collectives) --------

    def runs(self) -> list[Run]:
        """The bucket's leaves as :class:`Run` s (a leaf's slots are consecutive and equal),
        in slot order."""
        out: list[Run] = []
        for j, s in enumerate(self.slots):
            if s.part == 0:
                out.append(Run(**dataclasses.asdict(s), first=j))
        return out

    @staticmethod
    def tensors(leaf: jax.Array, run: Run) -> jax.Array:
        """A leaf as its stacked tensors: a view that merges the stacking axes, no relayout.

        Args:
          leaf: the leaf of ``run`` (or an array of its shape).
          run: its :class:`Run` in this bucket.

        Returns:
          ``leaf`` as ``[parts, *inner]`` (:attr:`Run.inner`).
        """
        return leaf.reshape(run.parts, *run.inner)

    def run_bytes(self, buf: jax.Array, run: Run) -> jax.Array:
        """A leaf's codes out of a packed byte buffer.

        Args:
          buf: the bucket's bytes as :meth:`pack_bytes` lays them out (``u8[rows, B]``).
          run: the leaf's :class:`Run` in this bucket.

        Returns:
          Its codes, ``[parts, *inner]``, padding dropped.
        """
        B = self.codec.row_size
        start = run.row_offset * B
        span = buf.reshape(-1)[start : start + run.parts * run.rows * B]
        return span.reshape(run.parts, run.rows * B)[:, : run.size].reshape(run.parts,
                                                                            *run.inner)


def plan_buckets(
    shapes: list[tuple[int, ...]],
    codecs: list[Codec],
    num_shards: int,
    bucket_elems: int = DEFAULT_BUCKET_ELEMS,
    stacks: list[int] | None = None,
) -> tuple[Bucket, ...]:
    """Group leaves (by codec, in order) into buckets; see the module docstring.

    Args:
      shapes, codecs: per leaf.
      num_shards: replicas the buckets split over (their rows are a multiple of it).
      bucket_elems: capacity of a bucket (a larger leaf gets one of its own).
      stacks: per leaf, how many tensors it stacks along its leading axes (default 1 each).

    Returns:
      The buckets, codec by codec in first-use order, leaves in tree order.
    """
    if bucket_elems <= 0:
        raise ValueError(f"bucket_elems={bucket_elems} must be positive")
    buckets = []
    for codec in dict.fromkeys(codecs):  # codecs in first-use order
        B = codec.row_size
        groups: list[list[Slot]] = [[]]
        rows = 0
        for i, (shape, c) in enumerate(zip(shapes, codecs, strict=True)):
            if c != codec:
                continue
            n = int(np.prod(shape, dtype=np.int64))
            parts = 1 if stacks is None else stacks[i]
            if n % parts:
                raise ValueError(f"leaf {i} of shape {shape} does not split into {parts} tensors")
            part_rows = max(1, -(-(n // parts) // B))
            if groups[-1] and (rows + parts * part_rows) * B > bucket_elems:
                groups.append([])
                rows = 0
            for part in range(parts):
                groups[-1].append(Slot(i, tuple(shape), rows, part_rows, part, parts))
                rows += part_rows
        for slots in groups:
            used = sum(s.rows for s in slots)
            buckets.append(Bucket(codec, tuple(slots), -(-used // num_shards) * num_shards))
    return tuple(buckets)
