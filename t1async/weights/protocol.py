"""What the learner uses of a weight sync (:class:`WeightSync`), its error, and the modes.

``weight_sync.mode``: ``distributed`` (t1async/weights/distributed.py: a torch.distributed
broadcast group with every sampler) or ``tensor`` (t1async/weights/tensor.py: handles to this
process's memory, for samplers on the learner's machine); both speak SGLang's own protocol
(pause, buckets, continue) and share the membership rules of t1async/weights/members.py.
:func:`t1async.weights.factory.make_weight_sync` builds one from the config.
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence

import torch

PAUSE_MODES = ("abort",)
"""Pause modes t1async accepts. SGLang also has ``retract`` and ``in_place``, which keep requests
alive across the update; the pinned release reports no per-token weight versions, so their
tokens would be labelled with one version while spanning two: refused."""

MODES = ("distributed", "tensor")
"""``weight_sync.mode`` values: :class:`~t1async.weights.distributed.DistributedWeightSync` or
:class:`~t1async.weights.tensor.TensorWeightSync`."""


class WeightSyncError(RuntimeError):
    """A sampler failed to join the weight group or to take an update."""


class WeightSync(Protocol):
    """The learner's side of weight publication: every member the learner's publisher (t1async/learner/publisher.py) uses.

    Membership: :meth:`connect` forms the group with the first samplers; :meth:`set_members`
    (thread-safe) names those to publish to from now on; :meth:`members` are those in service;
    :meth:`joiners` those that hold no weights from this learner yet. Attributes ``urls``
    (connected), ``failed`` (url -> why it was taken out of service), ``held`` (url -> version it
    holds) and, after each publish, ``last_pause_s`` / ``last_form_s`` (seconds the samplers were
    paused / the group took to re-form).
    """

    urls: list[str]
    failed: dict[str, str]
    held: dict[str, int]
    last_pause_s: float
    last_form_s: float

    def connect(self, sampler_urls: list[str]) -> None:
        """Form the group with ``sampler_urls`` (no weights sent yet)."""

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Pause every member, send every tensor as ``version``, resume those that took it all.

        Raises:
            WeightSyncError: a sampler failed (it is out of service, left paused).
        """

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, urls: Sequence[str]) -> None:
        """Give ``urls`` (joiners) the weights of the version the others hold, without pausing the others."""

    def set_members(self, urls: list[str]) -> None:
        """The samplers to publish to from now on."""

    def members(self) -> list[str]:
        """Samplers in service to publish to."""

    def joiners(self) -> list[str]:
        """Members that hold no weights from this learner yet."""

    def snapshot(self) -> dict[str, Any]:
        """``{"members", "failed", "held"}`` copied for another thread."""

    def close(self) -> None:
        """Leave the group and stop the worker threads."""
