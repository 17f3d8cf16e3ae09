"""Offline checkpoint functions (no context needed): verify, export, reshard."""
import os

from ._ffi import lib
from .errors import check
from ._util import _cstr, _new_struct, _progress_callback


def checkpoint_verify(path, tag=None, progress=None):
    """Check every checksum of a checkpoint (no context needed); ZsIOError
    names each file and tensor that fails."""
    held = []
    fn, user = _progress_callback(progress, held)
    check(lib.zs_checkpoint_verify(os.fsencode(path), _cstr(tag, held), fn, user))


def checkpoint_export(path, out_file, tag=None, fp32=False, progress=None):
    """One safetensors file of full tensors under their checkpoint names,
    streamed (memory bounded by a buffer); Hugging Face's from_pretrained
    and safetensors.torch.load_file read it."""
    held = []
    o = _new_struct("zs_checkpoint_export_options")
    o.tag = _cstr(tag, held)
    o.fp32 = 1 if fp32 else 0
    o.progress, o.progress_user = _progress_callback(progress, held)
    check(lib.zs_checkpoint_export(os.fsencode(path), os.fsencode(out_file), o))


def checkpoint_reshard(path, out_dir, world_size, tag=None, progress=None):
    """Rewrite a checkpoint for world_size ranks into out_dir (new)."""
    held = []
    fn, user = _progress_callback(progress, held)
    check(lib.zs_checkpoint_reshard(os.fsencode(path), _cstr(tag, held), os.fsencode(out_dir),
                                    int(world_size), fn, user))
