"""What a replacement needs of a trainer beside the engine's state, as JSON
bytes (docs/healing.md, section 1's table): this rank's own state (its RNG
states and the module buffers training changes), and the state every rank
shares (loop position, the `shared` objects' state_dict()).

JSON, never pickle: the bytes go through the job's store, which any rank of
the job can write. Tensors travel as base64 of their bytes with dtype and
shape; tuples, non-string dict keys and inf/nan are tagged so that a state
comes back as it was (random.getstate() needs its tuples, a state_dict its
int keys).
"""
import base64
import json
import math
import random
import sys

import torch

from . import heal_buffers


def encode(value, where="state"):
    """`value` as JSON-able data; TypeError naming where a value JSON cannot
    hold is."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": base64.b64encode(raw).decode("ascii"), "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape)}
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, (tuple, list)):
        # Python's RNG state is 625 ints: taken as they are, not one by one
        # (the blob is made at every optimizer step).
        items = list(value) if all(type(v) is int for v in value) else \
            [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"__dict__": {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
        return {"__items__": [[encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if type(value).__module__ == "numpy":
        import numpy as np
        if isinstance(value, np.ndarray):
            return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
        if isinstance(value, np.generic):
            return encode(value.item(), where)
    raise TypeError(f"zeroshard.torch healing: {where} is a {type(value).__name__}, which the healed state "
                    "cannot hold (JSON: tensors, numbers, strings, lists, tuples and dicts; no pickle)")


def decode(value):
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, value["dtype"])).reshape(value["shape"]).clone()
    if "__float__" in value:
        return float(value["__float__"])
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return {k: decode(v) for k, v in value["__dict__"].items()}
    if "__items__" in value:
        return {decode(k): decode(v) for k, v in value["__items__"]}
    if "__ndarray__" in value:
        import numpy as np
        return np.asarray(value["__ndarray__"], dtype=value["dtype"])
    raise ValueError(f"zeroshard.torch healing: an unknown tag in the healed state: {sorted(value)}")


def dumps(value, where="state"):
    return json.dumps(encode(value, where), separators=(",", ":")).encode("utf-8")


def loads(data):
    return decode(json.loads(data.decode("utf-8")))


def local_state():
    """This rank's own state, which a redone step starts from again and a
    replacement takes from its predecessor: its RNG states and the module
    buffers training changes (heal_buffers: BatchNorm's statistics)."""
    return {"rng": rng_state(), "buffers": heal_buffers.snapshot()}


def set_local_state(state):
    set_rng_state(state["rng"])
    heal_buffers.restore(state["buffers"])


def rng_state():
    """This process's RNG states: torch's CPU generator, each initialised
    CUDA device's, Python's `random`, and NumPy's global one when NumPy is
    loaded."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(tuple(state["numpy"]))
