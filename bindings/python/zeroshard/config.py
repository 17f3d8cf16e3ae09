"""Configs: read and checked as the engine does, without a context."""
import json
import os
import stat

from ._ffi import lib
from . import errors
from .errors import check


def _config_source(config):
    """(json_text, path) for a config given as dict, JSON text or path."""
    if config is None:
        return None, None
    if isinstance(config, dict) or (hasattr(config, "keys") and hasattr(config, "items")):
        return json.dumps(dict(config)), None
    if isinstance(config, bytes):
        config = config.decode("utf-8")
    if isinstance(config, str):
        if config.lstrip().startswith("{"):
            return config, None
        return None, config
    if isinstance(config, os.PathLike):
        return None, os.fspath(config)
    raise TypeError("config: expected a dict, JSON text or a path, got %s"
                    % type(config).__name__)


# The engine's limit on a config's size (impl/config/config.cpp).
_MAX_CONFIG_BYTES = 1 << 20


def _read_config_file(path):
    """A config file's text, read as the engine reads one: a regular file of
    at most _MAX_CONFIG_BYTES (never a FIFO or /dev/zero read forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise errors.InvalidConfigError("cannot read config file '%s': %s" % (path, e.strerror),
                                        errors.InvalidConfigError.status_code) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.InvalidConfigError(
            "config file '%s' is not a regular file, expected a regular file" % path,
            errors.InvalidConfigError.status_code)
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise errors.InvalidConfigError(
            "config file '%s' is more than %d bytes, expected at most %d"
            % (path, _MAX_CONFIG_BYTES, _MAX_CONFIG_BYTES), errors.InvalidConfigError.status_code)
    return data.decode("utf-8")


def config_check(config, world_size=0):
    """Validate a DeepSpeed config (dict, JSON text or path) without a context.

    Raises InvalidConfigError naming the JSON path on a bad value.
    world_size <= 0 skips the topology checks."""
    text, path = _config_source(config)
    if path is not None:
        text = _read_config_file(path)
    if text is None:
        text = "{}"
    check(lib.zs_config_check(text.encode("utf-8"), int(world_size)))


def inactive_config_message(keys):
    """The warning text for the engine's list of keys accepted but not acted
    on (Context.inactive_config_keys): one line per key."""
    return "\n".join(
        "zeroshard: config key %s = %s is accepted but not acted on yet: %s"
        % (k["key"], json.dumps(k["value"]), k["reason"]) for k in keys)
