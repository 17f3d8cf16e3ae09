"""Another engine's checkpoint as a zeroshard checkpoint, and a zeroshard
checkpoint as DeepSpeed's, offline:

    python -m zeroshard.convert SRC OUT [--tag T]      (zsckpt import SRC OUT runs it)
    python -m zeroshard.convert --to-deepspeed SRC OUT [--world N] [--tag T]
                                                       (zsckpt export-deepspeed SRC OUT runs it)

SRC: a DeepSpeed ZeRO-1/2/3 checkpoint directory (what engine.save_checkpoint
wrote: `latest` and global_stepN/), or a torch DCP directory FSDP2 wrote
with dcp.save({"model": ..., "optim": ...}). OUT receives OUT/<tag>
(default step-<N>) and OUT/latest in zeroshard's format: fp32 params, Adam
moments, the step and each group's hyper-parameters, and the source's other
state as the checkpoint's client_state (what zeroshard.torch.load_checkpoint
returns). One process holds the whole model (params and both moments,
fp32), one param at a time is read from the source; load the result at any
world size. DeepSpeed's files are read without running pickled code
(zeroshard.torch.deepspeed_checkpoint); DCP's through torch's reader.

--to-deepspeed: SRC is a zeroshard checkpoint (or a directory of them, or a
Hugging Face Trainer checkpoint-N/ holding zeroshard/); OUT receives
DeepSpeed ZeRO-3's layout for N ranks (default SRC's world size):
OUT/global_stepN/, OUT/latest and DeepSpeed's zero_to_fp32.py
(zeroshard.torch.deepspeed_export). DeepSpeed resumes it at N ranks only.
"""
import argparse
import json
import sys


def _deepspeed(tagdir):
    from .torch import deepspeed_checkpoint as ds
    ck = ds.DeepSpeedCheckpoint(tagdir)
    groups = []
    for g, names in enumerate(ck.groups):
        hp = ck.param_groups[g] if g < len(ck.param_groups) else ck.param_groups[-1]
        groups.append(([n for n, _ in names], hp))
    shapes = {n: tuple(s) for group in ck.groups for n, s in group}

    def read(name, state):
        return ck.read(name, state, 0, ck.numel(name)) if state == "param" or ck.has(state) else None
    return shapes, groups, read, ck.step(), ck.client_state()


def _dcp(path):
    import torch

    from .torch import dcp_checkpoint as dcp
    md = dcp._metadata(path)
    paths = md.planner_data or {k: tuple(k.split(".")) for k in md.state_dict_metadata}
    names = [p[1] for k, p in paths.items() if len(p) == 2 and k in md.state_dict_metadata
             and hasattr(md.state_dict_metadata[k], "size")]
    mprefix, oprefix, paths = dcp._layout(md, names)
    meta = md.state_dict_metadata
    names = [p[1] for k, p in paths.items() if p[0] == mprefix and len(p) == 2]
    shapes = {n: tuple(meta[f"{mprefix}.{n}"].size) for n in names}
    saved, step = dcp._groups_and_step(path, meta, paths, oprefix, names) if oprefix is not None else ([], None)
    others = dcp._others(path, meta, paths, (mprefix, oprefix))
    groups = [(list(g.get("params", [])), g) for g in saved] if oprefix is not None else [(names, {})]
    step = step or 0

    def read(name, state):
        key = f"{mprefix}.{name}" if state == "param" else f"{oprefix}.state.{name}.{state}"
        if state != "param" and (oprefix is None or key not in meta):
            return None
        return dcp._read(path, {key: torch.empty(shapes[name], dtype=torch.float32)})[key].reshape(-1)
    return shapes, groups, read, step, others


def _jsonable(x):
    """Tensors as lists: client_state is JSON in zeroshard's format."""
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def convert(src, out, tag=None):
    """Writes OUT/<tag> from SRC; returns its directory."""
    import torch

    import zeroshard as zs
    from .torch import dcp_checkpoint, deepspeed_checkpoint

    tagdir = deepspeed_checkpoint.find(src)
    if tagdir is not None:
        shapes, groups, read, step, client = _deepspeed(tagdir)
    elif dcp_checkpoint.find(src):
        shapes, groups, read, step, client = _dcp(src)
    else:
        raise ValueError(f"zeroshard.convert: {src} is neither a DeepSpeed checkpoint (latest, "
                         f"global_stepN/*_optim_states.pt) nor a torch DCP directory (.metadata)")
    user = json.dumps({"client_state": client, "buffers": {}}, default=_jsonable)
    with zs.Context(rank=0, world_size=1) as ctx:
        params, by_name, names = [], {}, []
        for name, shape in shapes.items():
            p = ctx.register(name, "float32", shape)
            p.write(read(name, "param").detach().contiguous().numpy())
            params.append(p)
            by_name[name] = p
            names.append(name)
        opt = ctx.optimizer("adamw")
        placed = set()
        for members, hp in groups:
            members = [n for n in members if n in by_name and n not in placed]
            if not members:
                continue
            placed.update(members)
            opt.add_group([by_name[n] for n in members], lr=hp.get("lr", 1e-3),
                          betas=tuple(hp.get("betas", (0.9, 0.999))), eps=hp.get("eps", 1e-8),
                          weight_decay=hp.get("weight_decay", 0.01),
                          bias_correction=bool(hp.get("bias_correction", True)))
        rest = [n for n in names if n not in placed]
        if rest:
            raise ValueError(f"zeroshard.convert: params {rest[:5]} are in no optimizer group of {src}")
        for name in names:
            for slot, state in ((1, "exp_avg"), (2, "exp_avg_sq")):
                values = read(name, state)
                if values is not None:
                    torch.from_dlpack(opt.state_dlpack(by_name[name], slot)).copy_(values)
        opt.steps = step
        return ctx.save_checkpoint(out, params, optimizer=opt, tag=tag or f"step-{step}", names=names,
                                   user_json=user)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zeroshard.convert", description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--to-deepspeed", action="store_true",
                    help="write SRC (zeroshard) into OUT in DeepSpeed ZeRO-3's layout")
    ap.add_argument("--world", type=int, default=None, help="with --to-deepspeed: the world size that resumes it")
    args = ap.parse_args(argv)
    if args.world is not None and not args.to_deepspeed:
        ap.error("--world goes with --to-deepspeed")
    try:
        if args.to_deepspeed:
            from .torch import deepspeed_export
            where = deepspeed_export.export(args.src, args.out, world_size=args.world, tag=args.tag)
        else:
            where = convert(args.src, args.out, args.tag)
    except (ValueError, KeyError, OSError, ImportError) as e:
        print(f"zeroshard.convert: {e}", file=sys.stderr)
        return 1
    print(where)
    return 0


if __name__ == "__main__":
    sys.exit(main())
