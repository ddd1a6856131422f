"""Stateless random ops with a different seed on each device.

TensorFlow has no batched stateless random op: pfor vectorizes one whose
seed (or key, counter, or distribution parameter) differs between
positions with a `tf.while_loop` over the positions, which DTensor cannot
place (TF 2.21). These ops take `per_position`'s converter instead
(`converters`): one op per position, each with that position's seed, their
results stacked. Every device then draws exactly the numbers the same op
draws eagerly with its own seed (as debug mode does), at the cost of each
device drawing the numbers of every position, not only its own.
"""

SEEDED = frozenset({
    "StatelessMultinomial",
    "StatelessParameterizedTruncatedNormal",
    "StatelessRandomBinomial",
    "StatelessRandomGammaV2",
    "StatelessRandomGammaV3",
    "StatelessRandomGetKeyCounter",
    "StatelessRandomGetKeyCounterAlg",
    "StatelessRandomNormal",
    "StatelessRandomNormalV2",
    "StatelessRandomPoisson",
    "StatelessRandomUniform",
    "StatelessRandomUniformFullInt",
    "StatelessRandomUniformFullIntV2",
    "StatelessRandomUniformInt",
    "StatelessRandomUniformIntV2",
    "StatelessRandomUniformV2",
    "StatelessShuffle",
    "StatelessTruncatedNormal",
    "StatelessTruncatedNormalV2",
})


