"""The search agent's curriculum: whole episodes over the generated knowledge base, in the workflow's tokens.

An episode is the workflow's prompt (`search_prompt` of style `PROMPT`), then model turns `<search> query
</search>`, each followed by the `<information>...</information>` block the workflow would insert for that query
(the same BM25 retrieval of the same corpus, `SEARCH_TOPK` documents, `format_information`; labels -100 there and
on the prompt), and a last turn `<answer> ... </answer>`. The mix is a base model RL can improve: a share
`BEHAVIOURS["right"]` of the episodes searches the question's entity (and, for two hops, the city its page names)
and answers from the results; the others answer at once with a guess, search another entity of the same sort
and answer from its page, or search right but answer wrong (a guess, or the city when two hops were needed).
The sampled policy then searches at least once in ~3/4 of its episodes but is right in only a part of them.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

from areal_pipeline.warm_start import IGNORE, Example, Sampler

# The episodes' format, as configs/search_agent.yaml runs them: the question alone in the chat template (the
# instruction would triple the length of every sequence the tiny model is trained on) and 1 result a search.
# The config refuses to run a model warm-started on these episodes in another format (`WRITTEN_FOR`).
PROMPT = "question"
SEARCH_TOPK = 1
WRITTEN_FOR = {"rollout.workflow": "search_agent", "rollout.agent.prompt": PROMPT,
               "rollout.agent.information": "docs", "rollout.agent.retrieval.topk": SEARCH_TOPK}
# The first questions of the train split, as configs/search_agent.yaml's dataset.max_train_size: few enough
# entities that the byte-level tiny model learns to write their names within a few hundred steps (a 64-wide one
# still garbled 60% of the names of the whole train split after 1200).
TRAIN_QUESTIONS = 64
BEHAVIOURS = {"right": 0.35, "no_search": 0.25, "wrong_entity": 0.2, "wrong_answer": 0.2}


def curriculum(tokenizer, tiny: Any, seed: int) -> Sampler:
    """Episodes on the first `TRAIN_QUESTIONS` generated train questions (the test split stays unseen)."""
    from areal_pipeline.config import RetrievalConfig
    from areal_pipeline.data.knowledge_base import knowledge_base
    from areal_pipeline.tools.retrieval_server import RetrievalService
    from areal_pipeline.workflows.search_agent import format_information, search_prompt, search_prompt_ids

    kb = knowledge_base()
    questions = kb.questions["train"][:TRAIN_QUESTIONS]
    # the entities of each sort, for wrong searches and guesses: people, countries; the facts by kind
    people = sorted({q["entity"] for q in questions if "city" in kb.facts[q["entity"]]})
    countries = sorted({q["entity"] for q in questions} - set(people))
    answers = {kind: sorted({kb.fact(e, kind) for e in people}) for kind in ("city", "year", "country", "capital")}
    with tempfile.TemporaryDirectory(prefix="search-curriculum-") as index_root:
        service = RetrievalService.from_config(RetrievalConfig(), Path(index_root))
        queries = sorted(set(people + countries) | {kb.facts[p]["city"] for p in people})
        pages = dict(zip(queries, service.search(queries, SEARCH_TOPK, False)["result"]))
    information = {q: tokenizer.encode(format_information(docs), add_special_tokens=False) for q, docs in pages.items()}
    prompts = [search_prompt_ids(tokenizer, search_prompt({"question": q["question"], "messages": [
        {"role": "user", "content": q["question"]}]}, PROMPT), PROMPT) for q in questions]
    names, weights = zip(*BEHAVIOURS.items())

    def turn(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def episode(rng: random.Random, i: int) -> Example:
        q = questions[i]
        kind, entity, searches = q["kind"], q["entity"], list(q["searches"])
        answer = q["answer"][0]
        behaviour = rng.choices(names, weights)[0]
        if behaviour == "no_search":
            searches, answer = [], rng.choice(answers[kind])
        elif behaviour == "wrong_entity":
            pool = people if "city" in kb.facts[entity] else countries
            other = rng.choice([e for e in pool if e != entity])
            searches = [other] + ([kb.facts[other]["city"]] if len(searches) == 2 else [])
            answer = kb.fact(other, kind)
        elif behaviour == "wrong_answer":
            if len(searches) == 2 and rng.random() < 0.5:
                searches, answer = searches[:1], kb.facts[entity]["city"]  # stopped one hop short
            else:
                answer = rng.choice([a for a in answers[kind] if a != answer])
        ids, labels = list(prompts[i]), [IGNORE] * len(prompts[i])
        for query in searches:
            action = turn(f"<search> {query} </search>")
            ids += action + information[query]
            labels += action + [IGNORE] * len(information[query])  # the environment's tokens carry no loss
        action = turn(f"<answer> {answer} </answer>")
        return ids + action, labels + action

    def sample(rng: random.Random, n: int) -> list[Example]:
        return [episode(rng, rng.randrange(len(questions))) for _ in range(n)]

    return sample
