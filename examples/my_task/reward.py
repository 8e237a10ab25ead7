"""This task's reward: reward.custom_function = "examples/my_task/reward.py:score" in config.toml.

Called once per response with the row's data_source, the response's text, its ground_truth and
extra_info (a dict); returns a number or {"score": ..., "acc": ...} (acc: 1/0 correctness, logged
as `acc`; without it, acc = score > 0).
"""


def score(data_source: str, response: str, ground_truth: str, extra_info: dict) -> dict:
    correct = response.strip()[:1] == ground_truth
    return {"score": float(correct), "acc": float(correct)}
