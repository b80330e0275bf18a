"""The LLM judge: ranks the trajectories of one group against each other (RULER-style).

``ranking`` asks the judge and turns its verdict into rewards, ``prompt`` renders the group for it,
``parse`` reads its answer, ``cache`` keeps verdicts by content hash.
"""

from agents.judge.cache import InMemoryJudgeCache, JudgeCache, LocalFolderJudgeCache
from agents.judge.ranking import JudgeConfig, JudgeError, judge_group, ruler_score_group

__all__ = ["InMemoryJudgeCache", "JudgeCache", "JudgeConfig", "JudgeError", "LocalFolderJudgeCache", "judge_group",
           "ruler_score_group"]
