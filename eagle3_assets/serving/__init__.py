"""The serving benchmark: what a recipe's drafter is worth where it is served.

Per recipe, after the drafter: every engine with a serve role serves the recipe's exports and the
target alone (the baseline) in the same run, over a sweep of speculative settings and concurrency
levels, on categorized real prompts. Dagster-free logic in the modules here; the thin asset and its
checks in ``assets.py`` and ``checks.py``.
"""
