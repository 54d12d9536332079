"""Evidence that decides: the shapes data and its exact scores, the validation loss, paired comparisons of
study records (intervals with and without per-sample scores, floors, the old scorer's mark, Holm, the
primary metric), and stage 1's end-to-end number."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from studies.evidence import (
    PILOTS,
    Question,
    SampleSets,
    apply_holm,
    check_questions,
    compare,
    fid_bootstrap,
    fmt_comparison,
    footnotes,
    min_effect,
)
from studies.evidence_stats import detectable, holm
from studies.validation_loss import bucket_means, triple_losses, validation_set

from mhla_gen import MHLAConfig, install_mhla
from mhla_gen.data.shapes import class_colour, class_count, shapes_tensors
from mhla_gen.errors import ConfigError
from mhla_gen.metrics.fid import fid_from_features
from mhla_gen.metrics.shapes import property_scores
from mhla_gen.testing import tiny_dit
from mhla_gen.train.transfer import TransferHooks, end_to_end_errors, finalize, relative_error


# ------------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("resolution", [32, 64])
def test_shapes_are_deterministic_and_score_exactly_on_every_property(resolution):
    images, labels = shapes_tensors(resolution, 60, seed=3)
    again, _ = shapes_tensors(resolution, 60, seed=3)
    assert torch.equal(images, again) and images.shape == (60, 3, resolution, resolution)
    assert not torch.equal(images, shapes_tensors(resolution, 60, seed=4)[0])
    assert torch.equal(images, images.flip(-1))  # mirror-symmetric, exactly
    scores = property_scores(images, labels)
    for key in ("symmetric", "count", "colour", "shape", "all"):
        assert scores[key].all(), key
    assert (scores["symmetry_error"] == 0).all()
    fg = images.amax(1) > 0.5  # every foreground pixel has the class colour
    for i in range(10):
        assert torch.equal(images[i][:, fg[i]].T.unique(dim=0), torch.from_numpy(class_colour(i))[None])


def test_each_property_fails_when_its_content_is_broken():
    images, labels = shapes_tensors(32, 30, seed=5)
    half = images.clone()
    half[..., 16:] = 0  # the right half gone: neither symmetric nor the right count
    s = property_scores(half, labels)
    assert not s["symmetric"].any() and not s["count"].any() and s["colour"].all()
    recoloured = images[:, [1, 2, 0]]  # channels rotated: a hue 120 degrees away
    assert not property_scores(recoloured, labels)["colour"].any()
    wrong = (labels + 1) % 10  # another count, except 9 -> 0 (both 1 + c % 3 = 1)
    same = np.array([class_count(int(a)) == class_count(int(b)) for a, b in zip(labels, wrong)])
    assert np.array_equal(property_scores(images, wrong)["count"], same) and same.mean() < 0.2
    assert [2 * class_count(c) for c in range(4)] == [2, 4, 6, 2]


# ----------------------------------------------------------------------------------- validation loss
def _model():
    torch.manual_seed(0)
    model = tiny_dit(num_layers=1).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_validation_loss_is_deterministic_stratified_and_the_plain_formula():
    model, scheduler = _model(), DDPMScheduler(num_train_timesteps=1000)
    size, channels = model.config.sample_size, model.config.in_channels
    images, labels = torch.rand(10, channels, size, size), torch.arange(10) % 4
    vset = validation_set(images, labels, 40, 1000)
    again = validation_set(images, labels, 40, 1000)
    assert all(torch.equal(vset[k], again[k]) for k in vset)
    assert all(i * 25 <= t < (i + 1) * 25 for i, t in enumerate(vset["t"].tolist()))  # one per slice
    losses = triple_losses(model, scheduler, vset, batch_size=7)
    assert np.array_equal(losses, triple_losses(model, scheduler, vset, batch_size=7))  # bit-identical
    # another batching sums in another order: float32 rounding only (a few eps of the loss)
    np.testing.assert_allclose(losses, triple_losses(model, scheduler, vset, batch_size=40), rtol=1e-5)
    i = 13  # one triple by hand
    xt = scheduler.add_noise(vset["x0"][i:i + 1], vset["noise"][i:i + 1], vset["t"][i:i + 1])
    with torch.no_grad():
        out = model(xt, timestep=vset["t"][i:i + 1], class_labels=vset["labels"][i:i + 1]).sample
    want = (out[:, :channels] - vset["noise"][i:i + 1]).square().mean().item()
    assert losses[i] == pytest.approx(want, rel=1e-5)
    means = bucket_means(losses, 4)
    assert means["val_loss_b0"] == pytest.approx(losses[:10].mean())
    assert means["val_loss"] == pytest.approx(np.mean([losses[k * 10:(k + 1) * 10].mean() for k in range(4)]))


# ---------------------------------------------------------------------------------- noise and verdicts
def records(metric, values: dict[str, list[float]], step=5, **extra):
    return [{"arm": arm, "seed": seed, "step": step, metric: v, **extra}
            for arm, vals in values.items() for seed, v in enumerate(vals)]


def test_compare_without_per_sample_scores_says_so():
    """Records without per-sample scores: a FID interval over seeds alone (marked §), or with the
    recorded bootstrap spreads as a bound on the shared samples' noise (marked ‡), not divided by the
    seeds; the MDD comes from the pilot, not from these seeds."""
    recs = records("fid", {"x": [10.0, 11.0, 12.0], "y": [20.0, 20.5, 22.5]})
    c = compare(recs, "x", "y", "fid", 5)
    assert c["per_seed"] == {0: -10.0, 1: -9.5, 2: -10.5} and c["verdict"] == "resolved"
    assert c["marks"] == ("none",) and fmt_comparison(c).endswith("§") and "§" in footnotes([c])
    assert c["min_effect"] == pytest.approx(0.1 * 21.0)
    assert c["mdd"] == pytest.approx(detectable(PILOTS[("digits", "fid")][0], 3))
    bounded = compare([dict(r, fid_bootstrap_sd=4.0) for r in recs], "x", "y", "fid", 5)
    assert bounded["marks"] == ("bound",) and bounded["sampling_sd"] == pytest.approx(math.sqrt(32))
    assert bounded["ci"] > c["ci"] and bounded["ci"] > 1.959964 * math.sqrt(32)
    spread = compare(records("fid", {"x": [1.0, 11.0, 21.0], "y": [20.0, 20.5, 22.5]}), "x", "y", "fid", 5)
    assert spread["mdd"] == c["mdd"]  # the pilot's, whatever these seeds' spread
    assert min_effect("val_loss_b2", 0.5) == pytest.approx(0.02 * 0.5)  # a bucket: the validation loss's
    assert compare(recs, "x", "missing", "fid", 5)["n"] == 0


def test_a_rates_shared_sampling_noise_does_not_shrink_with_seeds():
    """Three seeds with the same difference of a rate (3 samples in 300): the t-interval is 0 wide; the
    shared sample set's binomial noise (a bound, old records) keeps it open, not divided by sqrt(3):
    bounded. On 100 000 samples per score the same difference is real but below the minimum effect:
    negligible. Two seeds: too few for any verdict."""
    def recs(samples, seeds=3):
        return [{"arm": a, "seed": s, "step": 1, "colour_accuracy": v, "fid_samples": samples,
                 "shapes_scorer": 2} for a, v in (("cpe", 0.98), ("plain", 0.99)) for s in range(seeds)]

    few = compare(recs(300), "cpe", "plain", "colour_accuracy", 1)
    assert few["verdict"] == "bounded" and few["marks"] == ("bound",)
    assert few["ci"] == pytest.approx(1.959964 * math.sqrt((0.98 * 0.02 + 0.99 * 0.01) / 300), rel=1e-4)
    assert compare(recs(100_000), "cpe", "plain", "colour_accuracy", 1)["verdict"] == "negligible"
    assert compare(recs(100_000, seeds=2), "cpe", "plain", "colour_accuracy", 1)["verdict"] == "too few seeds"
    none_paired = compare(recs(300), "cpe", "plain", "colour_accuracy", 2)  # no point at step 2
    assert none_paired["verdict"] == "too few seeds"


def test_both_arms_at_a_rates_floor_is_neither_not_equivalence():
    recs = records("symmetric_rate", {"a": [0.0, 0.0, 0.003], "b": [0.0, 0.0, 0.0]}, fid_samples=300,
                   data="shapes", shapes_scorer=2)
    c = compare(recs, "a", "b", "symmetric_rate", 5)
    assert c["verdict"] == "neither" and c["at_floor"]
    one = records("symmetric_rate", {"a": [0.3, 0.2, 0.25], "b": [0.0, 0.0, 0.0]}, fid_samples=300,
                  data="shapes", shapes_scorer=2)
    assert compare(one, "a", "b", "symmetric_rate", 5)["verdict"] == "resolved"


def test_old_scorer_records_are_marked():
    recs = records("all_correct", {"a": [0.3, 0.2, 0.25], "b": [0.0, 0.01, 0.0]}, fid_samples=300,
                   data="shapes")
    c = compare(recs, "a", "b", "all_correct", 5)
    assert "old scorer" in c["marks"] and "†" in fmt_comparison(c, 3) and "version 1" in footnotes([c])
    assert "old scorer" not in compare(recs, "a", "b", "fid_samples", 5)["marks"]


def test_holm_judges_the_secondaries_and_keeps_the_primary():
    """One question, a primary and three secondaries: a secondary whose own interval just excludes 0 is
    judged on its Holm-adjusted p (three tests) and is no longer resolved; the primary keeps its own."""
    values = {"val_loss": ([1.0, 1.1, 0.9], [2.0, 2.1, 1.9]), "fid": ([10.0, 14.0, 12.0], [20.0, 21.0, 22.0]),
              "label_accuracy": ([0.5, 0.6, 0.6], [0.4, 0.45, 0.4]),
              "all_correct": ([0.3, 0.35, 0.32], [0.3, 0.34, 0.33])}
    recs = [{"arm": arm, "seed": s, "step": 1, **{m: v[i][s] for m, v in values.items()}}
            for i, arm in enumerate(("a", "b")) for s in range(3)]
    cells = [compare(recs, "a", "b", m, 1) for m in values]
    raw = [c["verdict"] for c in cells]
    apply_holm(cells, primary=0)
    assert cells[0]["primary"] and "p_holm" not in cells[0] and cells[0]["verdict"] == raw[0] == "resolved"
    assert [c["p_holm"] for c in cells[1:]] == pytest.approx(holm([c["p"] for c in cells[1:]]))
    label = cells[2]
    assert label["p"] < 0.05 and label["p_holm"] >= 0.05 and raw[2] == "resolved"
    assert label["verdict"] == "undecided" and "Holm p" in fmt_comparison(label, 3)
    assert "(primary)" in fmt_comparison(cells[0])


def test_holm_reads_a_secondarys_bounded_on_its_family_wide_interval():
    """The same interval (0.1 +- 0.2 from 3 seeds' part alone, minimum effect 0.5) is bounded as the primary
    and as one of two secondaries, undecided as one of five (its 99 % interval reaches 0.56)."""
    from studies.evidence_stats import Interval

    def cell():
        var_seed = (0.2 / 4.302653) ** 2  # t_2's 97.5 % quantile: the seeds' part makes the +- 0.2
        iv = Interval(0.1, -0.1, 0.3, 3, var_seed, 0.0, 0.6, "bootstrap")
        return {"interval": iv, "p": iv.p, "n": 3, "min_effect": 0.5, "at_floor": False, "verdict": "bounded"}

    two = apply_holm([cell() for _ in range(3)], primary=0)
    assert [c["verdict"] for c in two] == ["bounded"] * 3
    five = apply_holm([cell() for _ in range(6)], primary=0)
    assert [c["verdict"] for c in five] == ["bounded"] + ["undecided"] * 5


def test_questions_must_declare_a_primary_metric():
    check_questions([Question("q", "a", "b", "val_loss")], ("val_loss", "fid"), "x")
    for bad in (Question("q", "a", "b", None), Question("q", "a", "b", "symmetric_rate"),
                Question("q", "a", "b", "fid", "middle")):
        with pytest.raises(ConfigError, match="primary metric"):
            check_questions([bad], ("val_loss", "fid"), "eval/x.py")


def write_point(root, grid, arm, seed, step, **arrays):
    folder = root / grid / "results" / arm / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / f"step{step:07d}_features.npz", **arrays)


def test_compare_resamples_the_points_per_sample_scores(tmp_path, monkeypatch):
    """With each point's per-sample scores on disk (SampleSets), every metric's interval is the joint
    bootstrap (no mark): the validation loss per triple (its buckets as strata), a rate per sample and
    the FID from the features; the per-seed differences are the records'."""
    import studies.evidence as evidence

    rng = np.random.default_rng(0)
    real = rng.normal(size=(200, 4))
    monkeypatch.setattr(evidence, "_real_features", lambda source, resolution: real)
    shared = rng.normal(size=64)  # arm a's own response to the shared triples
    recs = []
    for arm, shift in (("a", 0.3), ("b", 0.0)):
        for seed in range(3):
            val = 1.0 + shift + (shared if arm == "a" else 0) * 0.2 + rng.normal(0, 0.1, 64)
            hits = rng.random(50) < (0.6 if arm == "a" else 0.3)
            pool = rng.normal(shift, 1.0, size=(50, 4))
            write_point(tmp_path, "g", arm, seed, 8, val=val, pool=pool, all=hits)
            recs.append({"arm": arm, "seed": seed, "step": 8, "grid": "g", "data": "shapes", "resolution": 32,
                         "val_loss": float(np.mean([p.mean() for p in np.array_split(val, 4)])),
                         **{f"val_loss_b{k}": float(p.mean()) for k, p in enumerate(np.array_split(val, 4))},
                         "all_correct": float(hits.mean()), "fid_samples": 50, "shapes_scorer": 2,
                         "fid": fid_from_features(real, pool)})
    assert fid_bootstrap(real, pool, draws=10)["sd"] > 0  # one arm's own spread (recorded, not paired)
    samples = SampleSets(tmp_path)
    for metric in ("val_loss", "all_correct", "fid", "val_loss_b1"):
        c = compare(recs, "a", "b", metric, 8, samples)
        plain = compare(recs, "a", "b", metric, 8)
        assert c["marks"] == () and c["interval"].source == "bootstrap", metric
        assert c["mean"] == pytest.approx(plain["mean"], rel=1e-6), metric
        assert c["sampling_sd"] > 0, metric
    shifted = [dict(r, step=r["step"] - 8, result_step=8) for r in recs]  # relabelled, files kept
    assert compare(shifted, "a", "b", "fid", 0, samples)["marks"] == ()


# ------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("trainable", ["mhla", "all"])
def test_end_to_end_errors_equal_the_finalized_models_output_error(trainable):
    """The hooked measurement of the converted model (and of each one-softmax-layer hybrid) equals the
    output error of the model finalize() makes, against the stock model (the teacher). With trained
    projections (``all``), a layer put back to softmax is the teacher's layer again, weights included."""
    model = tiny_dit(num_layers=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    teacher = copy.deepcopy(model).eval()
    x = torch.randn(2, model.config.in_channels, model.config.sample_size, model.config.sample_size)
    batch = dict(hidden_states=x, timestep=torch.tensor([10, 20]), class_labels=torch.tensor([1, 2]))
    install_mhla(model, MHLAConfig(blocks=(2, 2)))
    hooks = TransferHooks(model.eval(), trainable)
    with torch.no_grad():  # stage 1 moved what it trains
        for p in hooks.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    got = end_to_end_errors(model, hooks, [batch], chosen=[0, 2])
    with torch.no_grad():
        want_teacher = teacher(**batch).sample

        def finalized(softmax):
            m = copy.deepcopy(model)
            for module in m.modules():  # the copy without the transfer hooks
                module._forward_hooks.clear()
                module._forward_hooks_with_kwargs.clear()
            final = finalize(m, softmax, hooks.teachers)
            for i in softmax:
                stock, kept = teacher.transformer_blocks[i].attn1, final.transformer_blocks[i].attn1
                assert all(torch.equal(a, b) for a, b in zip(stock.state_dict().values(),
                                                             kept.state_dict().values()))
            return relative_error(final(**batch).sample, want_teacher).item()

        assert got["all_mhla"] == pytest.approx(finalized([]), rel=1e-4)
        for i in range(3):
            assert got["keep_softmax"][i] == pytest.approx(finalized([i]), rel=1e-4)
        assert got["chosen"] == pytest.approx(finalized([0, 2]), rel=1e-4)
        assert got["all_mhla"] > 0
