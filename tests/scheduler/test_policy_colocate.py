"""Co-location, pure side: the interference model and the admission rule
(``policy.interference``, ``policy.colocate``; SEEDS.md P1-P3)."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace
from itertools import pairwise

import pytest

from scheduler.policy import PolicyConfig
from scheduler.policy.colocate import Budget, Sharer, admit, rank
from scheduler.policy.interference import (
    DEFAULT_BUSY,
    Estimate,
    Knowledge,
    Model,
    Observations,
    Outcomes,
    Profile,
    gain,
    parse_label,
)

GIB = 1024
CFG = PolicyConfig(colo_headroom_mib=0, colo_gain_margin=0.0)


# ------------------------------------------------------------------ labels


@pytest.mark.parametrize(
    ("label", "family", "batch"),
    [
        ("ResNet-50 (batch size 64)", "resnet-50", 64),
        ("Transformer (batch size 16)", "transformer", 16),
        ("bert-base bs=32", "bert-base", 32),
        ("bert_base_bs32", "bert base", 32),
        ("A3C", "a3c", None),
        ("CycleGAN", "cyclegan", None),
        ("LM (batch size 5)", "lm", 5),
        ("", "", None),
    ],
)
def test_a_label_gives_the_family_and_batch_size(label, family, batch):
    assert parse_label(label) == (family, batch)


# ------------------------------------------------------------------ model


def test_observations_keep_the_mean_and_variance_of_what_they_saw():
    xs = [0.1, 0.3, 0.2, 0.25, 0.4]
    obs = Observations.of(xs)
    assert obs.n == 5
    assert obs.mean == pytest.approx(statistics.mean(xs))
    assert obs.m2 / (obs.n - 1) == pytest.approx(statistics.variance(xs))


def test_observations_clamp_speedups_and_outliers():
    assert Observations.of([-0.5]).mean == 0.0  # sharing never speeds a job up
    assert Observations.of([100.0]).slowdown == pytest.approx(64.0)


def test_the_prior_without_evidence_is_the_time_slicing_model():
    model = Model(Knowledge())
    e = model.estimate(Profile("a"), Profile("b"))
    assert e.slowdown == pytest.approx(1 + DEFAULT_BUSY**2)
    assert (e.confidence, e.source, e.observations) == (0.0, "prior", 0)


def test_the_prior_says_the_smaller_job_suffers_more():
    model = Model(Knowledge())
    small, big = Profile("s", 2 * GIB), Profile("b", 14 * GIB)
    assert model.estimate(small, big).slowdown > model.estimate(big, small).slowdown


def test_a_job_that_barely_uses_the_gpu_barely_slows_its_partner():
    model = Model(Knowledge(busy={"loader-bound": 0.1, "compute": 0.95}))
    idle, busy = Profile("loader-bound"), Profile("compute")
    assert model.estimate(busy, idle).slowdown < 1.1
    assert model.estimate(busy, Profile("compute")).slowdown > 1.8


def test_the_estimate_converges_to_the_true_slowdown_and_grows_surer():
    true_r = 1.3
    rng = random.Random(5)
    obs = Observations()
    confidences = []
    for _ in range(40):
        obs = obs.add(math.log(true_r) + rng.gauss(0.0, 0.05))
        e = Model(Knowledge(pairs={("a", "b"): obs})).estimate(
            Profile("a"), Profile("b")
        )
        confidences.append(e.confidence)
    assert e.source == "pair" and e.observations == 40
    # within the noise: 5 % sigma over 40 samples, plus the prior's small pull
    assert e.slowdown == pytest.approx(true_r, rel=0.03)
    assert confidences == sorted(confidences)
    assert confidences[0] == pytest.approx(0.5)  # one observation: half sure


def _episodes(slowdown: float, n: int, by: float = 0.02) -> Observations:
    """``n`` episodes about ``slowdown``, alternately ``by`` under and over it
    in log."""
    x = math.log(slowdown)
    return Observations.of([x + (by if i % 2 else -by) for i in range(n)])


def test_a_pair_seen_again_and_again_is_judged_by_its_record_not_its_family():
    # Gavel's P100 table: A3C beside Transformer 16 runs 1.43x while the other
    # transformers beside A3C run about 2x. Three episodes of it, 2 % apart,
    # against eleven pairs of the family whose means stray from the prior by
    # far more than an episode's noise: the record decides
    family = {("A3C", f"Transformer (batch size {b})"): _episodes(r, 3)
              for b, r in [(32, 2.1), (64, 1.8), (128, 2.2), (256, 1.7), (512, 2.0),
                           (1024, 2.3), (2048, 1.9), (4096, 2.1), (8, 1.8),
                           (4, 2.2), (2, 1.9)]}  # fmt: skip
    target = ("A3C", "Transformer (batch size 16)")
    model = Model(Knowledge(pairs={**family, target: _episodes(1.43, 3)}))
    assert model.noise is not None and 0.02 < model.noise < 0.03
    # the family's spread (tau about 0.3 in log) against the noise: the prior
    # side is worth well under a tenth of an episode
    assert model.record_prior is not None and 0.0 < model.record_prior < 0.05
    e = model.estimate(Profile(target[0]), Profile(target[1]))
    assert e.source == "pair" and e.slowdown == pytest.approx(1.43, rel=0.01)
    # with every pair seen once the noise is unknown: the fixed weights, and the
    # family pulls the pair far toward its 2x
    once = {k: Observations.of([v.mean]) for k, v in family.items()}
    model = Model(Knowledge(pairs={**once, target: Observations.of([math.log(1.43)])}))
    assert model.noise is None and model.record_prior is None
    assert model.estimate(Profile(target[0]), Profile(target[1])).slowdown > 1.6


def test_the_family_informs_an_untried_batch_size():
    seen = Observations.of([math.log(1.1)] * 6)
    knowledge = Knowledge(
        pairs={("ResNet-18 (batch size 32)", "LM (batch size 5)"): seen}
    )
    e = Model(knowledge).estimate(
        Profile("ResNet-18 (batch size 64)"), Profile("LM (batch size 10)")
    )
    prior = Model(Knowledge()).estimate(Profile("x"), Profile("y"))
    assert e.source == "family"
    assert 1.1 < e.slowdown < prior.slowdown
    assert e.confidence == 0.0  # the family moves the estimate, not the confidence


def test_pairs_worse_than_the_structure_raise_the_prior_of_unseen_pairs():
    bad = Observations.of([math.log(2.5)] * 10)
    knowledge = Knowledge(pairs={("p", "q"): bad, ("q", "p"): bad})
    unseen = Model(knowledge).estimate(Profile("x"), Profile("y"))
    assert unseen.source == "prior"
    assert (
        unseen.slowdown
        > Model(Knowledge()).estimate(Profile("x"), Profile("y")).slowdown
    )


def _beside(
    partner: str, r: float, victims: int
) -> dict[tuple[str, str], Observations]:
    """``victims`` workloads observed beside ``partner``: each slowed ``r`` by it,
    it slowed 1.1 by each."""
    pairs = {}
    for i in range(victims):
        pairs[(f"victim-{partner}-{i}", partner)] = Observations.of([math.log(r)] * 2)
        pairs[(partner, f"victim-{partner}-{i}")] = Observations.of([math.log(1.1)] * 2)
    return pairs


def test_a_workload_that_slows_every_partner_is_expected_to_slow_a_new_one():
    knowledge = Knowledge(
        pairs={**_beside("hog", 2.2, victims=4), **_beside("gentle", 1.15, victims=4)}
    )
    model = Model(knowledge)
    hog = model.estimate(Profile("newcomer"), Profile("hog"))
    gentle = model.estimate(Profile("newcomer"), Profile("gentle"))
    # what the pooled residual alone predicts for any new pair
    pooled = model.estimate(Profile("newcomer"), Profile("stranger"))
    assert pooled.source == "prior"
    assert hog.source == gentle.source == "workloads"
    assert hog.slowdown > pooled.slowdown > gentle.slowdown
    assert hog.slowdown > 1.6 and gentle.slowdown < 1.35
    # what a workload does to others says nothing of what others do to it
    assert model.estimate(Profile("hog"), Profile("newcomer")).slowdown < 1.3
    # the effects move the estimate, not the confidence: the pair is still untried
    assert hog.confidence == gentle.confidence == 0.0


def test_a_workload_that_suffers_beside_everyone_is_expected_to_suffer_again():
    pairs = {}
    for i in range(4):
        pairs[("fragile", f"other-{i}")] = Observations.of([math.log(2.0)] * 2)
        pairs[(f"other-{i}", "fragile")] = Observations.of([math.log(1.1)] * 2)
        pairs[("sturdy", f"other-{i}")] = Observations.of([math.log(1.1)] * 2)
        pairs[(f"other-{i}", "sturdy")] = Observations.of([math.log(1.1)] * 2)
    model = Model(Knowledge(pairs=pairs))
    fragile = model.estimate(Profile("fragile"), Profile("newcomer"))
    sturdy = model.estimate(Profile("sturdy"), Profile("newcomer"))
    assert fragile.source == "workloads"
    assert fragile.slowdown > 1.5 > sturdy.slowdown


def test_a_workload_seen_in_more_pairs_moves_its_new_pairs_further():
    one = Model(Knowledge(pairs=_beside("hog", 2.2, victims=1)))
    eight = Model(Knowledge(pairs=_beside("hog", 2.2, victims=8)))
    seen = 2.2
    got = [
        m.estimate(Profile("newcomer"), Profile("hog")).slowdown for m in (one, eight)
    ]
    prior = one.estimate(Profile("newcomer"), Profile("stranger")).slowdown
    assert prior < got[0] < got[1] < seen


def test_gain_is_the_combined_normalised_throughput():
    assert gain(2.0, 2.0) == pytest.approx(1.0)
    assert gain(1.25, 1.25) == pytest.approx(1.6)


# ------------------------------------------------------------------ admission


class Table:
    """A model with given slowdowns (r_AB per ordered label pair), fully sure
    unless listed in ``unsure``: the rule is tested apart from the estimates."""

    def __init__(self, r: dict[tuple[str, str], float], unsure=()):
        self.r = r
        self.unsure = set(unsure)

    def harmful(self, a: str, b: str) -> bool:
        return False

    def estimate(self, a: Profile, b: Profile) -> Estimate:
        key = (a.workload, b.workload)
        if key in self.unsure or key[::-1] in self.unsure:  # never seen together
            return Estimate(self.r[key], 0.0, "prior", 0)
        return Estimate(self.r[key], 1.0, "pair", 10)


def job(i, label, mem=4 * GIB, *, cap=1.5, peak=None, shareable=True):
    return Sharer(i, Profile(label, mem), shareable, peak, cap)


def run(candidate, residents, model, *, cfg=CFG, mem=16 * GIB, slots=2, budget=None):
    return admit(
        candidate,
        residents,
        gpu_id=7,
        memory_total_mib=mem,
        slots=slots,
        model=model,
        config=cfg,
        budget=budget or Budget(per_pair=1, total=10),
    )


SYM = Table({("a", "b"): 1.2, ("b", "a"): 1.3})


def test_a_pair_that_gains_within_the_caps_is_admitted_with_its_numbers():
    got = run(job(1, "a"), [job(2, "b")], SYM)
    assert (got.admitted, got.rule, got.trial) == (True, "ok", False)
    assert dict(got.slowdowns) == {1: 1.2, 2: 1.3}
    assert got.gain == pytest.approx(1 / 1.2 + 1 / 1.3)
    assert got.partners == (2,)
    assert "predicted gain 1.60" in got.message


@pytest.mark.parametrize(
    ("r_ab", "r_ba", "admitted"),
    [
        (2.0, 2.0, False),  # r_AB * r_BA == r_AB + r_BA: no gain, refused
        (1.99, 2.0, True),  # just inside
        (3.0, 1.5, False),  # 1/3 + 2/3 == 1: refused
        (2.9, 1.5, True),
        (4.0, 1.4, False),  # 0.25 + 0.71 < 1
    ],
)
def test_rule_2_at_its_boundary_with_caps_of_2_or_more(r_ab, r_ba, admitted):
    model = Table({("a", "b"): r_ab, ("b", "a"): r_ba})
    got = run(job(1, "a", cap=None), [job(2, "b", cap=4.0)], model)
    assert got.admitted is admitted
    if not admitted:
        assert got.rule == "gain"
        assert "not over the 1.00" in got.message


@pytest.mark.parametrize(("r", "admitted"), [(1.46, True), (1.48, False)])
def test_protection_keeps_a_margin_under_the_cap(r, admitted):
    model = Table({("a", "b"): r, ("b", "a"): 1.1})
    cfg = PolicyConfig(colo_headroom_mib=0, colo_gain_margin=0.0)  # margin 2 %
    got = run(job(1, "a"), [job(2, "b")], model, cfg=cfg)
    assert got.admitted is admitted
    if not admitted:
        assert got.rule == "protection"


def test_the_gain_margin_is_configurable():
    cfg = PolicyConfig(colo_headroom_mib=0, colo_gain_margin=0.7)
    got = run(job(1, "a"), [job(2, "b")], SYM, cfg=cfg)  # gain 1.60 < 1.70
    assert (got.admitted, got.rule) == (False, "gain")


@pytest.mark.parametrize(
    ("cap_a", "cap_b", "admitted", "who"),
    [
        (1.5, 1.5, True, None),
        (1.1, 1.5, False, 1),  # the candidate asked for a tighter cap
        (1.5, 1.25, False, 2),  # the resident is protected too
        (None, None, True, None),  # best-effort: unbounded
    ],
)
def test_rule_3_protects_every_job_on_the_gpu(cap_a, cap_b, admitted, who):
    got = run(job(1, "a", cap=cap_a), [job(2, "b", cap=cap_b)], SYM)
    assert got.admitted is admitted
    if who is not None:
        assert got.rule == "protection"
        assert f"job {who} would run" in got.message


@pytest.mark.parametrize(
    ("mine", "theirs", "peak", "headroom", "admitted"),
    [
        (8, 8, None, 0, True),  # 16 GiB fits 16 GiB
        (8, 8, None, 1, False),  # with 1 MiB headroom each it does not
        (8, 4, 9, 0, False),  # the resident measured more than it declared
        (4, 4, 6, 0, True),
    ],
)
def test_rule_1_counts_declared_or_measured_memory_plus_headroom(
    mine, theirs, peak, headroom, admitted
):
    cfg = PolicyConfig(colo_headroom_mib=headroom, colo_gain_margin=0.0)
    resident = job(2, "b", theirs * GIB, peak=None if peak is None else peak * GIB)
    got = run(job(1, "a", mine * GIB), [resident], SYM, cfg=cfg)
    assert got.admitted is admitted
    if not admitted:
        assert got.rule == "memory"
        assert "over the GPU's 16.0 GiB" in got.message


def test_a_job_with_no_known_memory_need_cannot_share():
    got = run(job(1, "a", None), [job(2, "b")], SYM)
    assert (got.admitted, got.rule) == (False, "memory")
    assert "job 1 declares no GPU memory" in got.message


def test_rule_4_counts_the_jobs_on_the_gpu():
    model = Table({(x, y): 1.1 for x in "abc" for y in "abc" if x != y})
    two = [job(2, "b"), job(3, "c")]
    assert run(job(1, "a"), two, model).rule == "count"
    got = run(job(1, "a"), two, model, cfg=CFG, mem=32 * GIB, slots=3)
    assert got.admitted
    assert dict(got.slowdowns) == pytest.approx({1: 1.21, 2: 1.21, 3: 1.21})


@pytest.mark.parametrize("who", ["candidate", "resident"])
def test_a_job_that_asked_for_its_own_gpu_never_shares(who):
    got = run(
        job(1, "a", shareable=who != "candidate"),
        [job(2, "b", shareable=who != "resident")],
        SYM,
    )
    assert (got.admitted, got.rule) == (False, "exclusive")


def test_an_unknown_pair_is_a_trial_within_the_budget_then_refused():
    model = Table({("a", "b"): 1.7, ("b", "a"): 1.7}, unsure={("a", "b")})
    budget = Budget(per_pair=1, total=10)
    got = run(job(1, "a"), [job(2, "b")], model, budget=budget)
    # over the 1.5 cap by the prior, but a trial is judged on gain only
    assert (got.admitted, got.rule, got.trial) == (True, "trial", True)
    assert "exploration trial" in got.message
    budget.spend(frozenset(("a", "b")))
    again = run(job(3, "a"), [job(2, "b")], model, budget=budget)
    assert (again.admitted, again.rule) == (False, "budget")
    other = Table({("a", "c"): 1.2, ("c", "a"): 1.2}, unsure={("a", "c")})
    assert run(job(3, "a"), [job(4, "c")], other, budget=budget).admitted


def test_the_cluster_wide_trial_budget_caps_all_pairs():
    model = Table({("a", "b"): 1.2, ("b", "a"): 1.2}, unsure={("a", "b")})
    got = run(job(1, "a"), [job(2, "b")], model, budget=Budget(per_pair=5, total=0))
    assert got.rule == "budget"


def test_a_pair_seen_once_is_held_to_the_caps_even_while_unsure():
    class SeenOnce(Table):
        def estimate(self, a, b):
            return Estimate(1.7, 0.33, "pair", 1)

    got = run(job(1, "a"), [job(2, "b")], SeenOnce({}))
    assert (got.admitted, got.rule) == (False, "protection")


class Seen(Table):
    """Every ordered pair estimated at ``r`` from ``n`` episodes."""

    def __init__(self, r: float, n: int = 1):
        super().__init__({})
        self.slow, self.n = r, n

    def estimate(self, a, b):
        return Estimate(self.slow, self.n / (self.n + 1), "pair", self.n)


RETRY = PolicyConfig(colo_headroom_mib=0, colo_gain_margin=0.0)  # z = 2


def retry(model, *, cfg=RETRY, noise=0.012, budget=None):
    return admit(
        job(1, "a"),
        [job(2, "b")],
        gpu_id=7,
        memory_total_mib=16 * GIB,
        slots=2,
        model=model,
        config=cfg,
        budget=budget or Budget(per_pair=1, total=10),
        noise=noise,
    )


def test_a_known_pair_within_its_noise_of_the_cap_is_tried_again():
    # 1.48 x 1.02 = 1.51 is over the 1.5 cap; one episode's record, noise 0.012:
    # two standard errors allow up to 1.5 x e^0.024 = 1.536
    got = retry(Seen(1.48))
    assert (got.admitted, got.rule, got.trial) == (True, "trial", True)
    assert got.message.startswith("re-trial: the pair was seen in 1 episode,")
    # two episodes: the slack is 2 x 0.012 / sqrt(2), up to 1.526; three: none
    assert retry(Seen(1.49, n=2)).rule == "trial"
    assert retry(Seen(1.47 * 1.02, n=2)).rule == "protection"
    assert retry(Seen(1.48, n=3)).rule == "protection"


@pytest.mark.parametrize(
    ("model", "cfg", "noise", "spent"),
    [
        (Seen(1.6), RETRY, 0.012, False),  # over the cap beyond its noise
        (Seen(1.48), replace(RETRY, colo_retrial_z=None), 0.012, False),
        (Seen(1.48), RETRY, None, False),  # the noise is not known yet
        (Seen(1.48), RETRY, 0.012, True),  # the pair's trial budget is spent
    ],
    ids=["beyond-noise", "off", "no-noise", "budget"],
)
def test_a_known_pair_over_its_cap_is_refused_when_no_re_trial_applies(
    model, cfg, noise, spent
):
    budget = Budget(per_pair=1, total=10)
    if spent:
        budget.spend(frozenset(("a", "b")))
    got = retry(model, cfg=cfg, noise=noise, budget=budget)
    assert (got.admitted, got.rule, got.trial) == (False, "protection", False)
    assert "over its cap of 1.5x" in got.message


def test_a_trial_the_prior_says_loses_is_not_tried():
    model = Table({("a", "b"): 2.5, ("b", "a"): 2.5}, unsure={("a", "b")})
    got = run(job(1, "a"), [job(2, "b")], model)
    assert (got.admitted, got.rule) == (False, "gain")
    assert "prior, untried pair" in got.message


@pytest.mark.parametrize(
    ("trial_margin", "admitted"), [(0.10, False), (0.05, True), (0.0, True)]
)
def test_a_trial_must_clear_the_trial_margin_a_known_pair_only_the_gain_margin(
    trial_margin, admitted
):
    # 1/1.85 + 1/1.85 = 1.081: over a gain margin of 0.05, under a trial margin of 0.10
    cfg = PolicyConfig(
        colo_headroom_mib=0,
        colo_gain_margin=0.05,
        colo_trial_gain_margin=trial_margin,
    )
    uncapped = [job(2, "b", cap=None)]
    untried = Table({("a", "b"): 1.85, ("b", "a"): 1.85}, unsure={("a", "b")})
    got = run(job(1, "a", cap=None), uncapped, untried, cfg=cfg)
    assert (got.admitted, got.rule) == (
        (True, "trial") if admitted else (False, "gain")
    )
    if not admitted:
        assert "not over the 1.10 that sharing must beat" in got.message
    known = Table({("a", "b"): 1.85, ("b", "a"): 1.85})
    got = run(job(1, "a", cap=None), uncapped, known, cfg=cfg)
    assert (got.admitted, got.rule) == (True, "ok")


def test_rank_prefers_known_pairs_then_gain_then_similar_size():
    me = job(1, "a", 4 * GIB)
    near, far = [job(2, "b", 5 * GIB)], [job(3, "b", 15 * GIB)]
    good = run(me, near, SYM)
    trial_model = Table({("a", "b"): 1.05, ("b", "a"): 1.05}, unsure={("a", "b")})
    trial = run(me, near, trial_model)
    assert rank(good, me, near) < rank(trial, me, near)
    same_far = run(me, far, SYM, mem=32 * GIB)
    assert same_far.admitted
    assert rank(good, me, near) < rank(same_far, me, far)
    better = run(me, far, Table({("a", "b"): 1.1, ("b", "a"): 1.1}), mem=32 * GIB)
    assert rank(better, me, far) < rank(good, me, near)


# ------------------------------------------------------------------ trial odds


def tried(*pairs: tuple[str, str, float]) -> dict[tuple[str, str], Observations]:
    """Each (a, b, slowdown both ways) observed once in both directions."""
    out = {}
    for a, b, r in pairs:
        out[a, b] = out[b, a] = Observations.of([math.log(r)])
    return out


ODDS = {"cap": 1.5, "need_gain": 1.05, "cap_margin": 0.02}


def test_with_nothing_tried_a_pair_has_even_odds():
    got = Outcomes(Knowledge()).odds("LM (batch size 5)", "A3C", **ODDS)
    assert (got.p, got.wins, got.tried, got.families) == (0.5, 0, 0, ("a3c", "lm"))


def test_odds_are_learned_per_family_pair_then_per_relation():
    # same-family pairs lost (LM, ResNet-18, Recommendation with themselves);
    # pairs of two families shared well twice in three
    k = Knowledge(pairs=tried(
        ("LM (batch size 5)", "LM (batch size 10)", 2.2),
        ("ResNet-18 (batch size 16)", "ResNet-18 (batch size 32)", 1.9),
        ("Recommendation (batch size 512)", "Recommendation (batch size 1024)", 1.8),
        ("LM (batch size 5)", "Recommendation (batch size 512)", 1.2),
        ("Recommendation (batch size 512)", "ResNet-18 (batch size 16)", 1.25),
        ("LM (batch size 5)", "ResNet-18 (batch size 16)", 1.7),
    ))  # fmt: skip
    out = Outcomes(k)
    # a new same-family pair of a family never tried: its relation's record
    p_same = (0 + 1) / (3 + 2)
    assert out.odds("CycleGAN", "CycleGAN", **ODDS).p == pytest.approx(p_same)
    # a new pair of two new families: pairs of two families do better
    p_diff = (2 + 1) / (3 + 2)
    assert out.odds("A3C", "CycleGAN", **ODDS).p == pytest.approx(p_diff)
    # a new batch size of a family pair that shared well: its families' record,
    # shrunk to its relation's as if 2 pairs had shown that
    got = out.odds("LM (batch size 80)", "Recommendation (batch size 8192)", **ODDS)
    assert (got.wins, got.tried) == (1, 1)
    assert got.p == pytest.approx((1 + 2 * p_diff) / (1 + 2))
    # the caps decide what "shared well" means: uncapped, the 1.7x pair gains too
    uncapped = out.odds("CycleGAN", "A3C", cap=None, need_gain=1.05, cap_margin=0.02)
    assert uncapped.p == pytest.approx((3 + 1) / (3 + 2))


def test_a_harmful_pair_counts_as_a_failure_and_nothing_new_is_tried_after_many():
    # K80: every pair tried ran over the cap or out of memory
    names = [f"W{i}" for i in range(30)]
    k = Knowledge(harmful=frozenset(frozenset(p) for p in pairwise(names)))
    got = Outcomes(k).odds("X1", "X2", **ODDS)
    assert got.p == pytest.approx(1 / (29 + 2))  # under 0.04
    model = Table({("x1", "x2"): 1.2, ("x2", "x1"): 1.2}, unsure={("x1", "x2")})
    refused = admit(
        job(1, "x1"), [job(2, "x2")], gpu_id=7, memory_total_mib=16 * GIB, slots=2,
        model=model, config=PolicyConfig(colo_headroom_mib=0, colo_trial_min_odds=0.04),
        budget=Budget(1, 10),
        outcomes=Outcomes(k),
    )  # fmt: skip
    assert (refused.admitted, refused.rule) == (False, "odds")
    assert "of 0 tried pair(s) of x1 and x2, 0 could share" in refused.message


def test_a_running_trial_counts_at_once_and_never_over_what_is_recorded():
    # K80-like: eight pairs of two families were evicted, so a new one has odds
    # 1/10; two trials running within the caps count as wins now, not hours
    # later when their episodes end
    names = [f"W{i}" for i in range(9)]
    k = Knowledge(harmful=frozenset(frozenset(p) for p in pairwise(names)))
    out = Outcomes(k)
    assert out.odds("X1", "X2", **ODDS).p == pytest.approx(1 / 10)
    live = {
        frozenset(("Y1", "Y2")): (gain(1.2, 1.3), 1.3),
        frozenset(("Y3", "Y4")): (gain(1.1, 1.2), 1.2),
        # a pair already recorded harmful keeps its record
        frozenset(("W0", "W1")): (gain(1.1, 1.1), 1.1),
    }
    more = out.with_live(live)
    assert more.odds("X1", "X2", **ODDS).p == pytest.approx(3 / 12)
    # the outcomes of the knowledge itself are left as they were
    assert out.odds("X1", "X2", **ODDS).p == pytest.approx(1 / 10)
    assert out.with_live({}) is out
