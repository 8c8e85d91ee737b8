"""Stage state as bytes without pickle: safetensors for the tensors, a typed JSON manifest for the rest.

Stage state (weights, optimizer state, loss scaler) crosses process boundaries twice: on the wire to a
joiner or a re-syncing replica, and on disk as a checkpoint. Both come from outside the process (a
peer, a file someone placed), so decoding must never execute code: ``torch.load`` without
``weights_only`` and every pickle do. The encoding here is one **safetensors** blob (its tensors
named by their path in the state, e.g. ``model/layers.0.attn.wq.weight`` or
``optimizer/state/3/exp_avg``) whose ``__metadata__["skippipe"]`` holds a JSON **manifest**: the
state's tree with every tensor replaced by ``{"t": name}``, plus whatever the caller adds (stage,
iteration, run configuration, meta). The tree keeps its types exactly: dicts are ``{"d": [[key,
value], ...]}`` (keys are strings or integers: the optimizer's state is keyed by parameter index),
lists ``{"l": [...]}``, tuples ``{"u": [...]}`` (AdamW's betas); leaves are None, booleans,
integers, floats and strings. Nothing else decodes.

Decoding reads and checks the safetensors header first (its size, every entry's dtype, shape and
offsets) and, given an :class:`ExpectedState` (what the receiver's own stage holds), checks the
tree's tensor names, shapes and dtypes against it **before** any tensor is materialised; then
``safetensors.torch.load`` copies the tensors out (safetensors' own parser checks the offsets again).

:func:`weights_digest` (SHA-256 over the model weights in name order: name, dtype, shape, raw bytes)
binds a served blob to its sender's header. Verification against the stage's other replicas uses
:func:`weights_sketch` instead: honest replicas differ by all-reduce rounding, so only a comparison
that tolerates rounding can tell them from a liar (see :mod:`node.dataplane.state_transfer`).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

__all__ = ["StateCodecError", "ExpectedState", "encode_state", "decode_state", "read_manifest",
           "weights_digest", "weights_sketch", "sketches_agree", "max_state_bytes", "tensors_finite",
           "MANIFEST_KEY"]

#: ``__metadata__`` key of the safetensors header that holds our manifest.
MANIFEST_KEY = "skippipe"
#: Largest safetensors header we parse (names + shapes of a few thousand tensors plus the manifest are
#: well under 1 MiB; safetensors itself allows 100 MB, far more than any honest stage needs).
MAX_HEADER_BYTES = 16 << 20
#: Deepest nesting of the manifest tree (the optimizer's state is 4 deep); bounds recursion on hostile input.
MAX_DEPTH = 16
#: Most tensors in one state (a 500M-parameter stage has a few hundred parameters, x3 with AdamW).
MAX_TENSORS = 100_000
#: Longest string leaf or key in the manifest.
MAX_STRING = 64 * 1024
#: Bytes a state blob may carry beyond its tensors: the safetensors header, 8-byte alignment of each
#: tensor and the manifest; ``max_state_bytes`` adds this to the tensors' own size.
OVERHEAD_BYTES = 1 << 20
#: Per tensor on top of :data:`OVERHEAD_BYTES`: its header entry and alignment padding.
PER_TENSOR_OVERHEAD = 512

_DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class StateCodecError(ValueError):
    """Bytes that are not a state blob of the expected layout (never executed, only refused)."""


@dataclass(frozen=True)
class TensorSpec:
    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass
class ExpectedState:
    """What a receiver's own stage holds: the model's tensors by name and the optimizer's parameter
    shapes in order. Downloaded state must match it exactly (names, shapes, dtypes) for the model;
    optimizer tensors must be scalars or have their parameter's shape, in a floating dtype."""

    model: Dict[str, TensorSpec]
    params: List[TensorSpec] = field(default_factory=list)

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> "ExpectedState":
        return cls({k: TensorSpec(tuple(v.shape), v.dtype) for k, v in module.state_dict().items()},
                   [TensorSpec(tuple(p.shape), p.dtype) for p in module.parameters()])

    def tensor_bytes(self) -> int:
        return sum(math.prod(s.shape) * _elsize(s.dtype) for s in self.model.values())

    def max_bytes(self) -> int:
        """The largest honest blob for this stage: weights + AdamW's two moments (and its optional
        third) per parameter + step counters, plus header and manifest room."""
        params = sum(math.prod(s.shape) * max(4, _elsize(s.dtype)) for s in self.params)
        n_tensors = len(self.model) + 4 * len(self.params) + 8
        return self.tensor_bytes() + 3 * params + n_tensors * PER_TENSOR_OVERHEAD + OVERHEAD_BYTES


def max_state_bytes(module: torch.nn.Module) -> int:
    """Response-size limit for ``module``'s stage state (see :meth:`ExpectedState.max_bytes`)."""
    return ExpectedState.of_module(module).max_bytes()


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------- encoding
def _plain(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor safetensors can store: contiguous and owning exactly its bytes (no shared storage)."""
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone()
    return t


def _encode_tree(obj: Any, path: str, tensors: Dict[str, torch.Tensor], seen: set, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise StateCodecError(f"state nests deeper than {MAX_DEPTH} at {path!r}")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        name = path or "tensor"
        if name in tensors:
            raise StateCodecError(f"two tensors would both be named {name!r}")
        t = _plain(obj)
        if t.data_ptr() in seen and t.numel():
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
        return {"t": name}
    if isinstance(obj, Mapping):
        items = []
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise StateCodecError(f"state key {k!r} at {path!r} is neither a string nor an integer")
            items.append([k, _encode_tree(v, f"{path}/{k}" if path else str(k), tensors, seen, depth + 1)])
        return {"d": items}
    if isinstance(obj, (list, tuple)):
        enc = [_encode_tree(v, f"{path}/{i}" if path else str(i), tensors, seen, depth + 1) for i, v in enumerate(obj)]
        return {"u" if isinstance(obj, tuple) else "l": enc}
    raise StateCodecError(f"cannot store a {type(obj).__name__} at {path!r} (only tensors, numbers, strings, "
                          "None, dicts, lists and tuples)")


def encode_state(state: Mapping[str, Any], manifest: Optional[Mapping[str, Any]] = None) -> bytes:
    """One safetensors blob of ``state`` (a nested dict of tensors and plain values) plus ``manifest``
    (JSON-able; stored next to the tree under ``"state"``)."""
    import safetensors.torch

    tensors: Dict[str, torch.Tensor] = {}
    tree = _encode_tree(state, "", tensors, set())
    doc = dict(manifest or {})
    doc["state"] = tree
    try:
        text = json.dumps(doc, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError) as e:
        raise StateCodecError(f"manifest is not JSON: {e}") from None
    return safetensors.torch.save(tensors, metadata={MANIFEST_KEY: text})


# ---------------------------------------------------------------------- decoding
def _parse_header(blob: bytes) -> Tuple[Dict[str, TensorSpec], dict]:
    """(tensor name -> spec, manifest) from a blob's safetensors header, without touching tensor data."""
    if len(blob) < 8:
        raise StateCodecError(f"{len(blob)} bytes is too short for a state blob")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(blob):
        raise StateCodecError(f"header of {n} bytes does not fit (blob of {len(blob)} bytes, at most "
                              f"{MAX_HEADER_BYTES})")
    try:
        header = json.loads(bytes(blob[8:8 + n]).decode("utf-8"))
    except RecursionError:
        raise StateCodecError("header nests too deep") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise StateCodecError(f"header is not JSON: {str(e)[:100]}") from None
    if not isinstance(header, dict):
        raise StateCodecError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not isinstance(meta.get(MANIFEST_KEY), str):
        raise StateCodecError("no skippipe manifest in the header (not a state blob of ours)")
    if len(header) > MAX_TENSORS:
        raise StateCodecError(f"{len(header)} tensors, at most {MAX_TENSORS}")
    data_len = len(blob) - 8 - n
    specs: Dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise StateCodecError(f"tensor {name[:80]!r}: unsupported or missing dtype")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)):
            raise StateCodecError(f"tensor {name[:80]!r}: bad shape")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_len):
            raise StateCodecError(f"tensor {name[:80]!r}: bad data offsets")
        dtype = _DTYPES[entry["dtype"]]
        if offsets[1] - offsets[0] != math.prod(shape) * _elsize(dtype):
            raise StateCodecError(f"tensor {name[:80]!r}: {offsets[1] - offsets[0]} bytes for shape {shape}")
        specs[name] = TensorSpec(tuple(shape), dtype)
    try:
        manifest = json.loads(meta[MANIFEST_KEY])
    except RecursionError:
        raise StateCodecError(f"manifest nests deeper than {MAX_DEPTH}") from None
    except ValueError as e:
        raise StateCodecError(f"manifest is not JSON: {str(e)[:100]}") from None
    if not isinstance(manifest, dict) or "state" not in manifest:
        raise StateCodecError("manifest is not an object with a state tree")
    return specs, manifest


def _decode_tree(node: Any, leaf: Callable[[str], Any], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise StateCodecError(f"manifest nests deeper than {MAX_DEPTH}")
    if node is None or isinstance(node, (bool, int, float)):
        return node
    if isinstance(node, str):
        if len(node) > MAX_STRING:
            raise StateCodecError(f"a string of {len(node)} characters in the manifest")
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise StateCodecError(f"manifest node of type {type(node).__name__} is not a typed value")
    (kind, value), = node.items()
    if kind == "t":
        if not isinstance(value, str):
            raise StateCodecError("a tensor reference is not a name")
        return leaf(value)
    if kind in ("l", "u"):
        if not isinstance(value, list):
            raise StateCodecError("a list node does not hold a list")
        items = [_decode_tree(v, leaf, depth + 1) for v in value]
        return tuple(items) if kind == "u" else items
    if kind == "d":
        if not isinstance(value, list):
            raise StateCodecError("a dict node does not hold a list of pairs")
        out: Dict[Any, Any] = {}
        for pair in value:
            if not isinstance(pair, list) or len(pair) != 2:
                raise StateCodecError("a dict entry is not a [key, value] pair")
            k = pair[0]
            if isinstance(k, bool) or not isinstance(k, (str, int)) or (isinstance(k, str) and len(k) > MAX_STRING):
                raise StateCodecError(f"dict key {k!r:.40} is neither a string nor an integer")
            out[k] = _decode_tree(pair[1], leaf, depth + 1)
        return out
    raise StateCodecError(f"unknown manifest node kind {kind!r:.20}")


def read_manifest(blob: bytes) -> Tuple[dict, Any]:
    """``(manifest without the tree, tree with a TensorSpec per tensor)``: what a blob holds, no tensor read."""
    manifest, tree, _ = _read(blob)
    return manifest, tree


def _read(blob: bytes) -> Tuple[dict, Any, Any]:
    specs, manifest = _parse_header(blob)
    used: set = set()

    def spec(name: str) -> TensorSpec:
        if name not in specs:
            raise StateCodecError(f"manifest names tensor {name[:80]!r}, which the blob lacks")
        if name in used:
            raise StateCodecError(f"tensor {name[:80]!r} is referenced twice")
        used.add(name)
        return specs[name]

    raw = manifest.pop("state")
    tree = _decode_tree(raw, spec)
    if used != set(specs):
        raise StateCodecError(f"{len(set(specs) - used)} tensors in the blob are not in the manifest")
    return manifest, tree, raw


def _check_expected(tree: Any, expected: ExpectedState) -> None:
    """Raise :class:`StateCodecError` unless ``tree`` (specs in place of tensors) fits ``expected``."""
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict):
        raise StateCodecError("state has no model weights")
    model = tree["model"]
    if set(model) != set(expected.model):
        missing, extra = sorted(set(expected.model) - set(model)), sorted(set(model) - set(expected.model))
        raise StateCodecError(f"model tensors differ from this stage's: missing {missing[:3]}, unexpected "
                              f"{[str(e)[:60] for e in extra[:3]]}")
    for name, want in expected.model.items():
        got = model[name]
        if got != want:
            raise StateCodecError(f"model tensor {name}: {_show(got)}, this stage holds {_show(want)}")
    opt = tree.get("optimizer")
    if opt is None:
        return
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(
            opt.get("param_groups"), list):
        raise StateCodecError("optimizer state is not {state, param_groups}")
    n = len(expected.params)
    listed = []
    for group in opt["param_groups"]:
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise StateCodecError("an optimizer param group has no parameter list")
        for k, v in group.items():
            if isinstance(v, TensorSpec):
                raise StateCodecError(f"optimizer setting {k!r} is a tensor")
        listed.extend(group["params"])
    if sorted(x for x in listed if isinstance(x, int)) != list(range(n)) or len(listed) != n:
        raise StateCodecError(f"optimizer param groups do not list this stage's {n} parameters")
    for idx, entry in opt["state"].items():
        if not isinstance(idx, int) or not 0 <= idx < n or not isinstance(entry, dict):
            raise StateCodecError(f"optimizer state for parameter {idx!r:.20}, which this stage lacks")
        for k, v in entry.items():
            if isinstance(v, TensorSpec):
                if v.shape not in ((), expected.params[idx].shape) or not v.dtype.is_floating_point:
                    raise StateCodecError(f"optimizer tensor {k!r} of parameter {idx}: {_show(v)}, parameter is "
                                          f"{_show(expected.params[idx])}")
            elif not (v is None or isinstance(v, (bool, int, float))):
                raise StateCodecError(f"optimizer value {k!r:.40} of parameter {idx} is not a number")


def _show(s: Any) -> str:
    if isinstance(s, TensorSpec):
        return f"{list(s.shape)} {str(s.dtype).replace('torch.', '')}"
    return type(s).__name__


def decode_state(blob: bytes, expected: Optional[ExpectedState] = None) -> Tuple[dict, Any]:
    """``(manifest, state)`` of a blob made by :func:`encode_state`; with ``expected`` the state's
    tensors are checked against it before any is loaded. :class:`StateCodecError` for anything else."""
    import safetensors.torch

    manifest, tree, raw = _read(blob)
    if expected is not None:
        _check_expected(tree, expected)
    try:
        tensors = safetensors.torch.load(bytes(blob))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types on bad bytes
        raise StateCodecError(f"tensor data unreadable: {str(e)[:160]}") from None
    state = _decode_tree(raw, tensors.__getitem__)
    return manifest, state


def weights_digest(model_state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over a stage's model weights in name order: name, dtype, shape, raw bytes."""
    sha = hashlib.sha256()
    for name in sorted(model_state):
        t = _plain(model_state[name])
        sha.update(name.encode())
        sha.update(f"|{_DTYPE_NAMES.get(t.dtype, str(t.dtype))}|{list(t.shape)}|".encode())
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        sha.update(t.numpy().tobytes() if t.numel() else b"")
    return sha.hexdigest()


def tensors_finite(model_state: Mapping[str, torch.Tensor]) -> Tuple[bool, List[str]]:
    """(every floating tensor finite, names of the tensors that are all zero)."""
    finite, zero = True, []
    for name, t in model_state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            finite = False
        if t.numel() and not bool(t.any()):
            zero.append(name)
    return finite, zero



# ---------------------------------------------------------------------- sketches
#: Random projections per tensor in a sketch (plus its RMS): two make a perturbation that happens to be
#: orthogonal to one of them irrelevant.
SKETCH_PROJECTIONS = 2
#: Two sketches agree when every value differs by at most this fraction of the tensor's RMS. Honest
#: replicas are not bit-identical (hivemind's all-reduce adds each peer's own delta, and rounding
#: differs), but they differ by float32 rounding (~1e-7 of the RMS); a change that matters is far
#: larger. A perturbation of RMS r moves each projection by about r, so this is the size of change
#: (relative to the tensor's RMS) that can slip through.
SKETCH_RTOL = 1e-3
#: Absolute floor of the comparison, for tensors that are legitimately (near) zero.
SKETCH_ATOL = 1e-12
#: Longest sketch a peer may send: (1 + projections) values for each of MAX_TENSORS tensors.
MAX_SKETCH_VALUES = (1 + SKETCH_PROJECTIONS) * MAX_TENSORS


def weights_sketch(model_state: Mapping[str, torch.Tensor], nonce: bytes) -> List[float]:
    """A fingerprint of a stage's weights that tolerates rounding: for each tensor in name order, its
    RMS and :data:`SKETCH_PROJECTIONS` projections onto random directions drawn from ``nonce``.

    The nonce is chosen by the verifier after it holds the blob it checks, so whoever served that blob
    could not have shaped its weights to fool these particular directions."""
    seed = int.from_bytes(hashlib.sha256(bytes(nonce)).digest()[:8], "little") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    out: List[float] = []
    with torch.no_grad():
        for name in sorted(model_state):
            w = model_state[name].detach().to("cpu").reshape(-1).double()
            n = max(w.numel(), 1)
            out.append(float(w.pow(2).sum().div(n).sqrt()))
            for _ in range(SKETCH_PROJECTIONS):
                r = torch.randn(w.numel(), generator=gen, dtype=torch.float32).double()
                out.append(float((w * r).sum()) / math.sqrt(n))
    return out


def sketches_agree(a: List[float], b: List[float]) -> bool:
    """True when two sketches of the same stage describe the same weights up to rounding."""
    step = 1 + SKETCH_PROJECTIONS
    if len(a) != len(b) or len(a) % step:
        return False
    for i in range(0, len(a), step):
        scale = SKETCH_RTOL * max(abs(a[i]), abs(b[i])) + SKETCH_ATOL
        for x, y in zip(a[i:i + step], b[i:i + step]):
            if not (math.isfinite(x) and math.isfinite(y)) or abs(x - y) > scale:
                return False
    return True
