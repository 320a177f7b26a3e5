"""The reward of planner/examples/your-data/job.yaml: 1 when the response ends with the sum."""


def compute_score(prompt: str, response: str, row: dict) -> dict:
    words = response.split()
    return {"score": 1.0 if words and words[-1] == row["answer"] else 0.0}
