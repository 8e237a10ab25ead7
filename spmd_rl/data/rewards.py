"""Rule-based rewards, chosen per row by its data_source, or a user's custom function.

Every scorer returns {"score": float, "acc": float}: "acc" is 1/0 correctness, "score" is what
training optimises (acc plus the optional format bonus). Built-in scorers:

  "openai/gsm8k" or any name containing "gsm8k"   answer after "#### " (strict) or last number (flexible)
  names starting with "synthetic/"                 first integer in the response, exact match

With `reward.custom_function` set, that function scores every row instead. With
`rollout.environment` set, a data source neither scores is the environment's alone: a trajectory it
gives no reward scores 0.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from fractions import Fraction
from typing import Any, Callable, NamedTuple

from spmd_rl.config.reward import RewardConfig
from spmd_rl.errors import UserError
from spmd_rl.user_import import import_object

log = logging.getLogger("spmd_rl")

class RewardError(UserError, ValueError):
    """A reward cannot be computed: unknown data source, bad custom function or bad return value."""


# A number, where a minus sign counts only if it cannot be a subtraction ("10-3" is 10 and 3) and
# commas count only as thousands separators ("1,2,3" is three numbers, "1,000" one).
_NUMBER = r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_GSM8K_LINE_RE = re.compile(r"####\s*\$?\s*" + _NUMBER + r"\.?")
_INTEGER_RE = re.compile(r"(?:(?<![\w)])-)?\d+")


def normalize_number(text: str) -> str:
    """'1,234' -> '1234' (also strips spaces and a leading '$')."""
    return text.strip().lstrip("$").replace(",", "")


def numbers_equal(a: str, b: str) -> bool:
    """Equal as numbers ("18" == "18.0" == "18.00"), else as normalized strings."""
    a, b = normalize_number(a), normalize_number(b)
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return a == b


# --------------------------------------------------------------------------- gsm8k


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The answer of a GSM8K response, commas removed; None when there is none.

    strict: the number after the last "#### " (an optional "$" is allowed);
    flexible: the last number anywhere in the text.
    """
    if method == "strict":
        matches = _STRICT_RE.findall(text)
    elif method == "flexible":
        matches = _NUMBER_RE.findall(text)
    else:
        raise RewardError(f"reward.gsm8k_method = {method!r} is not 'strict' or 'flexible'")
    return normalize_number(matches[-1]) if matches else None


def gsm8k_format_ok(text: str) -> bool:
    """Whether some line of the response is just "#### N"."""
    return any(_GSM8K_LINE_RE.fullmatch(line.strip()) for line in text.splitlines())


def score_gsm8k(response: str, ground_truth: str, method: str = "strict", format_bonus: float = 0.0) -> dict:
    answer = extract_gsm8k_answer(response, method)
    acc = float(answer is not None and numbers_equal(answer, ground_truth))
    bonus = format_bonus if format_bonus and gsm8k_format_ok(response) else 0.0
    return {"score": acc + bonus, "acc": acc}


# --------------------------------------------------------------------------- synthetic


def extract_first_integer(text: str) -> str | None:
    """The first integer in the text ("ab7x12" -> "7"); None when there is none."""
    m = _INTEGER_RE.search(text)
    return m.group(0) if m else None


def synthetic_format_ok(text: str) -> bool:
    """Whether the response is exactly one integer (EOS and padding are already stripped)."""
    return _INTEGER_RE.fullmatch(text) is not None


def score_synthetic(response: str, ground_truth: str, format_bonus: float = 0.0) -> dict:
    # The first integer, not the last: a random model then scores ~10% on single-digit answers,
    # which gives RL a signal to start from.
    answer = extract_first_integer(response)
    acc = float(answer is not None and numbers_equal(answer, ground_truth))
    bonus = format_bonus if format_bonus and synthetic_format_ok(response) else 0.0
    return {"score": acc + bonus, "acc": acc}


# --------------------------------------------------------------------------- dispatch


def extract_answer(data_source: str, response: str, gsm8k_method: str = "strict") -> str | None:
    """The final answer a built-in scorer would grade (for maj@k votes): the integer of synthetic
    tasks, GSM8K's number; for other sources the stripped response itself."""
    if data_source.startswith("synthetic/"):
        answer = extract_first_integer(response)
        return normalize_number(answer) if answer is not None else None
    if "gsm8k" in data_source.lower():
        return extract_gsm8k_answer(response, gsm8k_method)
    return response.strip() or None



def builtin_scorer(data_source: str, cfg: RewardConfig) -> Callable[[str, str], dict]:
    """scorer(response, ground_truth) for a data source, or RewardError naming the fix."""
    if data_source.startswith("synthetic/"):
        return lambda response, gt: score_synthetic(response, gt, cfg.format_bonus)
    if "gsm8k" in data_source.lower():
        return lambda response, gt: score_gsm8k(response, gt, cfg.gsm8k_method, cfg.format_bonus)
    raise RewardError(f"no built-in reward for data_source {data_source!r} (built in: 'openai/gsm8k' or any "
                      "name containing 'gsm8k', and 'synthetic/...'): set reward.custom_function = "
                      "'package.module:function' or 'path/to/file.py:function' to score it, or let "
                      "rollout.environment give the reward")


def load_custom_reward(spec: str) -> Callable:
    """The function named by "package.module:function" (or "path/to/file.py:function")."""
    return import_object(spec, "reward.custom_function", RewardError, "function")


class ScoringErrors(NamedTuple):
    """What `RewardFunction.sync_failures` counted over all ranks since its last call."""

    count: int
    """Responses scored 0 because their scorer failed (reward.on_error = "zero")."""
    responses: int
    """Responses the reward function was asked to score."""
    first: str | None
    """The first failure of the lowest rank that had one: the data source, row, error and response."""


class RewardFunction:
    """Scores batches of decoded responses.

    With `cfg.custom_function` the user's fn(data_source, response, ground_truth, extra_info) scores
    every row; it may return a number (the score; acc = 1.0 if score > 0 else 0.0) or a dict with
    "score" and optionally "acc" (same default). It is loaded and its signature checked here, so a
    bad config fails at start. Without it, each row's data_source picks a built-in scorer.
    """

    def __init__(self, cfg: RewardConfig, defer_errors: bool = False):
        self.cfg = cfg
        self.defer_errors = defer_errors
        self.failure: str | None = None
        self.errors = 0
        self.first_error: str | None = None  # on_error = "zero": the first failure since sync_failures
        self.responses = 0
        self.environment_only: set[str] = set()
        """Data sources without a scorer whose reward is the environment's (check_data_sources)."""
        if cfg.gsm8k_method not in ("strict", "flexible"):
            raise RewardError(f"reward.gsm8k_method = {cfg.gsm8k_method!r} is not 'strict' or 'flexible'")
        self.custom = load_custom_reward(cfg.custom_function) if cfg.custom_function else None
        if self.custom is not None:
            try:
                inspect.signature(self.custom).bind("source", "response", "truth", {})
            except TypeError:
                raise RewardError(f"reward.custom_function = {cfg.custom_function!r} must accept "
                                  "(data_source, response, ground_truth, extra_info)") from None
            except ValueError:  # builtins without a signature: trust them
                pass

    def check_data_sources(self, data_sources, environment: str = "") -> None:
        """Fail now, not at the first step, if some data source has no scorer; with an
        `environment` (rollout.environment) such a source is scored by the environment's reward
        alone, 0 for a trajectory it gives none (one line says so)."""
        if self.custom is not None:
            return
        for source in sorted(set(data_sources)):
            try:
                builtin_scorer(source, self.cfg)
            except RewardError:
                if not environment:
                    raise
                self.environment_only.add(source)
        if self.environment_only:
            log.info("reward: data_source %s has no scorer: rollout.environment's reward is the reward, 0 for a "
                     "trajectory it gives none (multiturn/stop_* shows how trajectories ended)",
                     ", ".join(map(repr, sorted(self.environment_only))))

    def score_one(self, data_source: str, response: str, ground_truth: str, extra_info: dict | None) -> dict:
        if self.custom is None:
            if data_source in self.environment_only:  # the environment gave this trajectory no reward
                return {"score": 0.0, "acc": 0.0}
            return builtin_scorer(data_source, self.cfg)(response, ground_truth)
        return self._custom_result(self.custom(data_source, response, ground_truth, extra_info or {}))

    def _score_guarded(self, index: Any, data_source: str, response: str, ground_truth: str,
                       extra_info: dict | None) -> dict:
        """score_one, with a scorer failure either scored 0 and counted (on_error = "zero") or
        recorded as a message naming the sample (the caller raises it)."""
        try:
            return self.score_one(data_source, response, ground_truth, extra_info)
        except Exception as e:  # the user's function can raise anything; we name the sample and move on
            name = self.cfg.custom_function or "the built-in scorer"
            shown = response if len(response) <= 200 else response[:200] + "..."
            what = (f"reward function {name} failed on data_source {data_source!r}, row {index} ({type(e).__name__}: "
                    f"{' '.join(str(e).split())}) for the response {shown!r}")
            if self.cfg.on_error == "zero":
                self.errors += 1
                self.first_error = self.first_error or what
            elif self.failure is None:
                self.failure = (what + ': fix the function, or set reward.on_error = "zero" to score such responses 0 '
                                "(counted in reward/errors)")
            return {"score": 0.0, "acc": 0.0}

    def sync_failures(self) -> ScoringErrors:
        """Collective over the process group (if any): raise the first failure of any rank on every
        rank, so all stop with the same message; else return, summed over all ranks since the last
        call, the responses scored 0 for an error (reward.on_error = "zero"), the responses scored
        and the first such error."""
        mine = (self.failure, self.errors, self.responses, self.first_error)
        self.failure, self.errors, self.responses, self.first_error = None, 0, 0, None
        import torch.distributed as dist

        gathered = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        failure = next((g[0] for g in gathered if g[0] is not None), None)
        if failure is not None:
            raise RewardError(failure)
        return ScoringErrors(sum(g[1] for g in gathered), sum(g[2] for g in gathered),
                             next((g[3] for g in gathered if g[3] is not None), None))

    def _custom_result(self, value: Any) -> dict:
        if isinstance(value, dict):
            if "score" not in value:
                raise RewardError(f"reward.custom_function {self.cfg.custom_function!r} returned a dict "
                                  f"without 'score': {value!r}")
            score, acc = value["score"], value.get("acc")
        else:
            score, acc = value, None
        try:
            score = float(score)
            acc = float(score > 0) if acc is None else float(acc)
        except (TypeError, ValueError):
            raise RewardError(f"reward.custom_function {self.cfg.custom_function!r} must return a number or "
                              f"a dict with a numeric 'score', got {value!r}") from None
        if not math.isfinite(score):
            raise RewardError(f"reward.custom_function {self.cfg.custom_function!r} returned a non-finite "
                              f"score {score}")
        return {"score": score, "acc": acc}

    def __call__(self, data_sources: list[str], responses: list[str], ground_truths: list[str],
                 extra_infos: list[dict] | None = None, indices: list | None = None) -> list[dict]:
        """[{"score", "acc"}] per response; all lists are aligned (one entry per response).
        `indices` (dataset rows) name the sample in error messages. A failing scorer raises here,
        unless `defer_errors`: then `sync_failures()` raises it (on every rank)."""
        if extra_infos is None:
            extra_infos = [{}] * len(responses)
        lengths = {len(data_sources), len(responses), len(ground_truths), len(extra_infos)}
        if len(lengths) != 1:
            raise RewardError(f"reward inputs differ in length: {len(data_sources)} data sources, "
                              f"{len(responses)} responses, {len(ground_truths)} ground truths, "
                              f"{len(extra_infos)} extra_infos")
        if indices is None:
            indices = ["?"] * len(responses)
        self.responses += len(responses)
        results = [self._score_guarded(*row) for row in zip(indices, data_sources, responses, ground_truths, extra_infos)]
        if not self.defer_errors and self.failure is not None:
            failure, self.failure = self.failure, None
            raise RewardError(failure)
        return results
