"""The copy ceiling of ``litellm-flm bench --workloads``: the speed-up an oracle copy proposer would
give on the answers the model actually wrote.

Prompt lookup and the suffix proposer can only propose text that is already there: the request's
prompt, its output so far, earlier requests' outputs. Given an answer, the most any such proposer
can verify at decode position ``i`` is the longest run ``out[i:i + m]`` that occurs, whole, in
that text (``copy_lengths``); knowing it, an oracle picks per step how many of those tokens to
verify so that the answer costs least, a step verifying ``k`` tokens costing ``verify_ratio[k-1]``
decode steps and a plain step one (``cheapest_cost``: a shortest path over the positions). The
ceiling is decoded tokens / that cost: what the tag's retrieval proposers reach at best on this
host's verify curve, with no proposal ever wrong and no proposing cost. A workload whose ceiling
is below a target ratio cannot reach it by retrieval, however good the proposer; only a draft that
predicts text not in the context can.

``SubstringIndex`` is a suffix automaton (Blumer et al., "The smallest automaton recognizing the
subwords of a text", Theoretical Computer Science 40, 1985): built online in O(length) states, it
answers "how long a prefix of this pattern occurs somewhere in the text" by walking transitions
from the start, O(pattern length). Separate sequences are joined with separators of their own
(negative ids no token has), so no run spans two of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class SubstringIndex:
    """A suffix automaton over a growing token sequence (module docstring).

    ``add`` appends tokens; ``add_sequence`` starts a new sequence after a separator;
    ``longest_prefix(pattern)`` is the length of the longest prefix of ``pattern`` that occurs
    in the text.
    """

    def __init__(self) -> None:
        self._next: list[dict[int, int]] = [{}]  # state -> token -> state
        self._link: list[int] = [-1]             # suffix link
        self._length: list[int] = [0]            # longest string of the state
        self._last = 0
        self._separators = 0

    def add(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._extend(int(token))

    def add_sequence(self, tokens: Iterable[int]) -> None:
        """``tokens`` as a sequence of their own: no run found later spans its edges."""
        self._separators += 1
        self._extend(-self._separators)
        self.add(tokens)

    def longest_prefix(self, pattern: Sequence[int]) -> int:
        state, n = 0, 0
        for token in pattern:
            state = self._next[state].get(int(token), -1)
            if state < 0:
                break
            n += 1
        return n

    def _extend(self, token: int) -> None:
        nxt, link, length = self._next, self._link, self._length
        cur = len(nxt)
        nxt.append({})
        length.append(length[self._last] + 1)
        link.append(0)
        p = self._last
        while p >= 0 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p >= 0:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: a clone holds the shorter strings that now also end at cur
                clone = len(nxt)
                nxt.append(dict(nxt[q]))
                length.append(length[p] + 1)
                link.append(link[q])
                while p >= 0 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur


def copy_lengths(prompt: Sequence[int], output: Sequence[int], earlier: SubstringIndex, most: int) -> list[int]:
    """Per decode position ``i`` of ``output`` (1 .. len - 1: position 0 is the prefill's token),
    the longest run ``output[i:i + m]``, ``m`` <= ``most``, that occurs in ``prompt`` +
    ``output[:i]`` or in ``earlier`` (other requests' text)."""
    own = SubstringIndex()
    own.add(prompt)
    own.add(output[:1])
    lengths = []
    for i in range(1, len(output)):
        ahead = output[i:i + most]
        lengths.append(max(own.longest_prefix(ahead), earlier.longest_prefix(ahead)))
        own.add(output[i:i + 1])
    return lengths


def cheapest_cost(lengths: Sequence[int], verify_ratio: Sequence[float]) -> float:
    """The least cost, in decode steps, of producing the tokens ``lengths`` covers (one per
    position): a plain step at a position costs 1 and pushes 1 token; a step verifying ``k``
    tokens, 1 <= ``k`` <= min(``lengths[i]``, len(``verify_ratio``)), costs ``verify_ratio[k-1]``
    and pushes ``k`` + 1 (the bonus token), the last step possibly past the end."""
    n = len(lengths)
    best = [0.0] * (n + 1)  # best[i]: the cost of positions i .. n-1
    for i in range(n - 1, -1, -1):
        best[i] = 1.0 + best[i + 1]
        for k in range(1, min(lengths[i], len(verify_ratio)) + 1):
            best[i] = min(best[i], verify_ratio[k - 1] + best[min(n, i + k + 1)])
    return best[0]
