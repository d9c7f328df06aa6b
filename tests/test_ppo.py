"""PPO on the tiny model: the slot-scorer policy, a short training run (TensorBoard, checkpoint, resume), the
policy loaded as a controller, refused files, and the policy benchmark's equivalence with SB3's predict."""

import json
import shutil
import zipfile

import numpy as np
import pytest
import torch

from agents.ppo.controller import POLICY_ENTRY, PolicyFileError, PPOController, read_policy
from agents.ppo.network import SlotNetwork, SlotOpHead
from agents.ppo.train import latest_checkpoint, load_config, train
from agents.registry import make_controller
from kvgym.envs.observation import BLOCK_FEATURES, observation_space
from tests.conftest import make_tiny_llama
from tests.test_env import ByteTokenizer, make_env  # noqa: F401  (registers the toy_recall task)

TINY = ["traces.tasks=[toy_recall]", "traces.lengths=[160]", "traces.n=2", "eval.tasks=[toy_recall]",
        "eval.lengths=[160]", "env.prefill_chunk=32", "env.decide_every=2", "env.budget_range=[0.3, 0.6]",
        "eval.budget_range=[0.3, 0.6]", "eval.every=128", "total_timesteps=256", "checkpoint_every=128",
        "imitation.teacher=merge:mass", "imitation.steps=96", "imitation.epochs=3"]


def tiny_config(tmp_path, *extra):
    return load_config("ppo_tiny", [f"runs_dir={tmp_path / 'runs'}", f"traces.dir={tmp_path / 'traces'}", *TINY,
                                    *extra])


def test_slot_scorer_is_shared_across_slots_and_permutation_equivariant():
    torch.manual_seed(0)
    layers, k, features = 3, 5, len(BLOCK_FEATURES)
    network, head = SlotNetwork(layers, k, hidden=8), SlotOpHead(8)
    small = SlotNetwork(layers, 2, hidden=8)  # the same weights serve any K
    assert sum(p.numel() for p in network.parameters()) == sum(p.numel() for p in small.parameters())
    blocks = torch.rand(1, k, features)
    blocks[..., 0] = 1.0
    blocks[..., 1] = torch.tensor([0.0, 0.5, 1.0, 0.5, 0.0])
    flat = lambda b: torch.cat([torch.rand(1, layers, generator=torch.Generator().manual_seed(1)),  # noqa: E731
                                torch.full((1, 3), 0.2), b.reshape(1, -1), torch.full((1, 3), 0.5)], dim=1)
    logits = head(network.forward_actor(flat(blocks))).view(k, 4)
    order = torch.tensor([3, 0, 4, 1, 2])
    permuted = head(network.forward_actor(flat(blocks[:, order]))).view(k, 4)
    assert torch.allclose(permuted, logits[order], atol=1e-6)
    # the value does not depend on slot order either
    assert torch.allclose(network.forward_critic(flat(blocks)), network.forward_critic(flat(blocks[:, order])))
    # negative control: a dense (unshared) head is not equivariant
    dense = torch.nn.Linear(k * 8, k * 4)
    assert not torch.allclose(dense(network.forward_actor(flat(blocks[:, order]))).view(k, 4),
                              dense(network.forward_actor(flat(blocks))).view(k, 4)[order], atol=1e-4)
    # the initial keep bias makes an untrained policy mostly keep
    assert (logits.argmax(-1) == 0).all()


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="'ppo.n_stepz' is unknown"):
        load_config("ppo_tiny", ["ppo.n_stepz=3"])
    with pytest.raises(ValueError, match="batch_size 100 must divide"):
        load_config("ppo_tiny", ["ppo.batch_size=100"])
    with pytest.raises(ValueError, match="expected key=value"):
        load_config("ppo_tiny", ["total_timesteps"])
    with pytest.raises(FileNotFoundError, match="ppo_smollm2"):
        load_config("no_such_config")
    assert load_config("ppo_tiny", ["ppo.learning_rate=1e-4"])["ppo"]["learning_rate"] == 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 256-step run on the tiny model, then resumed to 384 steps and fine-tuned live for 64."""
    tmp_path = tmp_path_factory.mktemp("ppo")
    model, tokenizer = make_tiny_llama(), ByteTokenizer()
    config = tiny_config(tmp_path)
    run_dir = train(config, model=model, tokenizer=tokenizer, progress_bar=False)
    first = latest_checkpoint(run_dir)
    first_meta, _ = read_policy(run_dir / "policy.zip")
    with pytest.raises(FileExistsError, match="--resume"):
        train(config, model=model, tokenizer=tokenizer, progress_bar=False)
    resumed = tiny_config(tmp_path, "total_timesteps=384", "live_finetune_timesteps=64")
    train(resumed, resume=True, model=model, tokenizer=tokenizer, progress_bar=False)
    return dict(run_dir=run_dir, first=first, first_meta=first_meta, model=model, tokenizer=tokenizer,
                config=resumed)


def test_training_writes_tensorboard_scalars(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained["run_dir"] / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("cache/kl", "cache/reward_kl", "cache/mb_moved", "cache/evict", "cache/fallbacks",
                "train/approx_kl", "train/value_loss", "eval/mean_reward", "accuracy/ppo", "accuracy/lru",
                "accuracy/ppo_minus_best_baseline"):
        assert tag in tags, f"{tag} missing from {sorted(tags)}"
    kl = [event.value for event in events.Scalars("cache/kl")]
    assert all(np.isfinite(kl)) and max(kl) > 0  # budgets below 1 lose attention mass
    assert {event.step for event in events.Scalars("accuracy/ppo")} >= {128, 256}
    losses = [event.value for event in events.Scalars("imitation/loss")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # cloning the teacher lowers its loss
    imitation = json.loads((trained["run_dir"] / "imitation.json").read_text())
    assert imitation["teacher"] == "merge:mass" and imitation["samples"] == 96 and 0 <= imitation["agreement"] <= 1
    run = json.loads((trained["run_dir"] / "run.json").read_text())
    assert len(run["starts"]) == 2 and run["starts"][1]["resumed_from"]
    assert (trained["run_dir"] / "config.yaml").is_file()


def test_checkpoint_and_resume(trained, tmp_path):
    path, stats, steps = trained["first"]
    assert steps == 256 and path.is_file() and stats.is_file()
    assert trained["first_meta"]["timesteps"] == 256
    replay_meta, _ = read_policy(trained["run_dir"] / "policy_replay.zip")
    assert replay_meta["timesteps"] == 384 and replay_meta["config"]["total_timesteps"] == 384
    meta, _ = read_policy(trained["run_dir"] / "policy.zip")  # after the live fine-tune on the batched env
    assert meta["timesteps"] >= 384 + 64  # PPO collects whole rollouts (n_steps x n_envs = 128)
    assert latest_checkpoint(trained["run_dir"])[2] == 384
    # a checkpoint cut short by a kill is skipped: resume falls back to the previous one
    copy = tmp_path / "run"
    shutil.copytree(trained["run_dir"], copy)
    newest = copy / "checkpoints" / "ppo_384_steps.zip"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    assert latest_checkpoint(copy)[2] == 256


def test_loaded_policy_makes_legal_decisions_in_the_live_env(trained):
    controller = make_controller(f"ppo:{trained['run_dir'] / 'policy.zip'}")
    assert isinstance(controller, PPOController) and controller.num_layers == 2
    env = make_env(model=trained["model"], tokenizer=trained["tokenizer"], lengths=(160,), budget_range=(0.3, 0.3))
    env.reset(seed=5)
    steps = 0
    while not env.done:
        view = env.cache_view()
        decisions = controller.decide(view)
        legal = view.legal_ops
        assert all(bool(legal[d.layer, d.block, int(d.op)]) for d in decisions)
        info = env.step_decisions(decisions)[-1]
        assert info["within_budget"] and info["illegal_ops"] == 0
        steps += 1
    assert steps > 3


def test_direct_path_matches_sb3_predict(trained):
    from sb3_contrib import MaskablePPO

    path = trained["run_dir"] / "policy.zip"
    controller, agent = PPOController.load(path), MaskablePPO.load(str(path), device="cpu")
    env = make_env(model=trained["model"], tokenizer=trained["tokenizer"], lengths=(160,))
    observation, info = env.reset(seed=1)
    for _ in range(4):
        mask = info["action_mask"].astype(bool)
        prepared = {key: value.numpy() for key, value in controller.prepare(observation).items()}
        expected = agent.predict(prepared, action_masks=mask.reshape(1, -1), deterministic=True)[0][0]
        assert np.array_equal(controller.act(observation, mask), expected)
        observation, _, done, _, info = env.step(expected)
        if done:
            break


def test_corrupt_foreign_and_mismatched_files_are_refused(trained, tmp_path):
    good = trained["run_dir"] / "policy.zip"
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(PolicyFileError, match="corrupt"):
        PPOController.load(truncated)
    # valid zip, altered weights: the checksum catches it
    tampered = tmp_path / "tampered.zip"
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(tampered, "w") as target:
        for item in source.namelist():
            data = source.read(item)
            if item == "policy.pth":
                data = data[:-64] + bytes(64)
            target.writestr(item, data)
    with pytest.raises(PolicyFileError, match="sha256"):
        PPOController.load(tampered)
    # an SB3 zip without kvgym's entry
    foreign = tmp_path / "foreign.zip"
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(foreign, "w") as target:
        for item in source.namelist():
            if item != POLICY_ENTRY:
                target.writestr(item, source.read(item))
    with pytest.raises(PolicyFileError, match="not a kvgym policy"):
        PPOController.load(foreign)
    with pytest.raises(PolicyFileError, match="does not exist"):
        PPOController.load(tmp_path / "missing.zip")
    # a 2-layer policy on a 30-layer cache
    controller = PPOController.load(good)
    with pytest.raises(PolicyFileError, match="2-layer model; the cache has 30 layers"):
        controller.check_fits(30)


def test_bench_policy_reports_times_and_matches_sb3(trained):
    from agents.ppo.benchmark import bench_policy

    report = bench_policy(trained["run_dir"] / "policy.zip", repeats=20)
    assert report["same_action_as_sb3"] is True
    assert report["direct_masked_argmax"]["median_ms"] > 0 and report["sb3_predict"]["median_ms"] > 0
    fresh = bench_policy(None, num_layers=4, num_candidates=32, repeats=20)
    assert fresh["num_candidates"] == 32 and fresh["same_action_as_sb3"] is True
    space = observation_space(4, 32)
    assert space["blocks"].shape == (32 * len(BLOCK_FEATURES),)


def test_cli_train_refuses_unknown_keys(capsys):
    from kvgym.cli import main

    assert main(["train", "--config", "ppo_tiny", "ppo.lr=3"]) == 2
    assert "'ppo.lr' is unknown" in capsys.readouterr().err
