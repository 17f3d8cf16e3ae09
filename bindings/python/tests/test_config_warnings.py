"""Config keys the engine accepts but does not act on yet are never silent:
zeroshard.Context warns once per context (ZeroShardConfigWarning, rank 0)
naming each key with its value, and lists them in inactive_config_keys."""
import json
import warnings

import pytest

import zeroshard as zs

OFFLOAD = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "nvme_path": "/tmp/nvme"},
        "round_robin_gradients": True,
        "sub_group_size": 1e8,
    },
    "aio": {"queue_depth": 32},
    "optimizer": {"type": "AdamW"},
}


def _contexts_warnings(config, n=1):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        contexts = [zs.Context(rank=0, world_size=1, config=config) for _ in range(n)]
    for ctx in contexts:
        ctx.close()
    return [w for w in caught if issubclass(w.category, zs.ZeroShardConfigWarning)], contexts


def test_one_warning_names_every_key_and_value():
    got, _ = _contexts_warnings(OFFLOAD)
    assert len(got) == 1
    text = str(got[0].message)
    assert issubclass(got[0].category, UserWarning)
    assert ("zeroshard: config key zero_optimization.offload_optimizer.pin_memory = true is "
            "accepted but not acted on yet: offloaded optimizer state is not pinned") in text
    # "cpu" offload is acted on: on a CPU context the state and the shards
    # are in host memory.
    assert "offload_optimizer.device =" not in text and "offload_param.device =" not in text
    for line in ('zero_optimization.offload_param.nvme_path = "/tmp/nvme"',
                 'zero_optimization.round_robin_gradients = true',
                 'zero_optimization.sub_group_size = 100000000.0',
                 'aio.queue_depth = 32'):
        assert line in text, line
    assert len(text.splitlines()) == 5
    # The warning carries the engine's list; it points at the caller's line.
    assert [k["key"] for k in got[0].message.keys][0] == "zero_optimization.sub_group_size"
    assert got[0].filename == __file__
    # Trainer keys are still reported apart, not warned about.
    assert "optimizer =" not in text


def test_property_lists_the_same_keys():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zs.Context(rank=0, world_size=1, config=json.dumps(OFFLOAD)) as ctx:
            keys = ctx.inactive_config_keys
            assert ctx.unused_config_keys == ["optimizer"]
    assert {"key": "zero_optimization.offload_param.nvme_path", "value": "/tmp/nvme",
            "reason": 'read only by NVMe parameter offload (offload_param.device is "cpu")'
            } in keys
    assert len(keys) == 5


def test_once_per_context():
    got, _ = _contexts_warnings(OFFLOAD, n=2)
    assert len(got) == 2


@pytest.mark.parametrize("config", [
    None,
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"},
                           "zero_quantized_weights": False, "sub_group_size": 1e9}},
    {"optimizer": {"type": "AdamW"}, "train_micro_batch_size_per_gpu": 4},
])
def test_nothing_to_warn_about(config):
    got, contexts = _contexts_warnings(config)
    assert got == []


def test_effective_config_fed_back_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zs.Context(rank=0, world_size=1, config=OFFLOAD) as ctx:
            effective = ctx.config
    # The effective config keeps the offload device it was given, so it is
    # still listed; with offload off nothing else is.
    effective["zero_optimization"]["offload_optimizer"]["device"] = "none"
    effective["zero_optimization"]["offload_param"]["device"] = "none"
    effective["zero_optimization"]["offload_param"]["nvme_path"] = None
    effective["zero_optimization"]["offload_optimizer"]["nvme_path"] = None
    effective["zero_optimization"]["round_robin_gradients"] = False
    effective["zero_optimization"]["sub_group_size"] = 1000000000
    effective["aio"]["queue_depth"] = 8
    got, _ = _contexts_warnings(effective)
    assert got == []


def test_warning_can_be_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error", zs.ZeroShardConfigWarning)
        with pytest.raises(zs.ZeroShardConfigWarning, match="offload_param.nvme_path"):
            zs.Context(rank=0, world_size=1, config=OFFLOAD)
