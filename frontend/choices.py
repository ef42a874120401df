"""How `select` turns per-token logprobs of each choice into a decision.

Each method gets, per choice, the logprobs of the choice's tokens after the prompt (and, when it
asks for them, after a neutral context: `unconditional`), and returns the chosen index with the
scores it compared. Pass one as `select(..., choices_method=...)`.
"""

from __future__ import annotations

import abc
import dataclasses
import math


@dataclasses.dataclass
class ChoiceDecision:
    index: int
    scores: list[float]  # one per choice; higher is better


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: scores[i])


class ChoicesMethod(abc.ABC):
    name = ""
    needs_unconditional = False

    @abc.abstractmethod
    def __call__(self, logprobs: list[list[float]], unconditional: list[list[float]] | None = None) -> ChoiceDecision:
        """The decision from per-choice token logprobs (and, when needed, unconditional ones)."""

    def __repr__(self) -> str:
        return self.name


class TokenLengthNormalized(ChoicesMethod):
    """The choice with the highest mean logprob per token (SGLang's default)."""

    name = "token_length_normalized"

    def __call__(self, logprobs, unconditional=None):
        scores = [_mean(lps) for lps in logprobs]
        return ChoiceDecision(_argmax(scores), scores)


class GreedyTokenSelection(ChoicesMethod):
    """What greedy decoding would pick: keep the choices whose first token is most likely, then
    among those the most likely second token, and so on; a choice that has ended competes with its
    mean logprob. Ties left at the end go to the higher mean."""

    name = "greedy_token_selection"

    def __call__(self, logprobs, unconditional=None):
        means = [_mean(lps) for lps in logprobs]
        alive = list(range(len(logprobs)))
        for pos in range(max(len(lps) for lps in logprobs)):
            if len(alive) == 1:
                break
            at = {i: logprobs[i][pos] if pos < len(logprobs[i]) else means[i] for i in alive}
            best = max(at.values())
            alive = [i for i in alive if at[i] >= best - 1e-9]
        index = max(alive, key=lambda i: means[i])
        scores = [1.0 if i in alive else 0.0 for i in range(len(logprobs))]
        return ChoiceDecision(index, scores)


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """Mean logprob after the prompt minus mean logprob after a neutral context: corrects for
    choices that are likely whatever was asked (surface-form competition)."""

    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def __call__(self, logprobs, unconditional=None):
        assert unconditional is not None
        scores = [_mean(c) - _mean(u) for c, u in zip(logprobs, unconditional)]
        return ChoiceDecision(_argmax(scores), scores)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
