"""Theorem 3.1 of PORTool (METHODS 2.7), reproduced through the project's real kernels.

Toy two-step tabular policy. Step 1 from the prompt: NEC (necessary: the only way to a correct
answer) or USE (a useless alternative). After NEC, step 2 answers correctly (+1) or wrongly
(-1), and the policy usually answers wrongly; after USE the episode always ends "unable" (0).
A rollout tree of 8 trajectories: NEC -> {correct, wrong, wrong, wrong}, USE -> {unable x4}.

GRPO (one advantage per trajectory) lowers pi(NEC); PORTool (max-aggregated step reward and
fork advantages) raises it.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from steprl_jax.ops.advantages import group_zscore, tree_advantages
from steprl_jax.ops.logprobs import token_logprobs
from steprl_jax.ops.losses import policy_loss, safe_divide
from steprl_jax.ops.tree_arrays import ArrayTreeNode, RolloutTree, node_values_to_tokens, stack_trees

NEC, USE = 0, 1          # step-1 tokens
CORRECT, WRONG = 0, 1    # step-2 tokens after NEC
OUTCOMES = [+1, -1, -1, -1, 0, 0, 0, 0]  # rows 0-3 took NEC, rows 4-7 took USE


def _batch():
    """One row per trajectory: [step-1 token, step-2 token]; hidden = one-hot tabular state."""
    targets = np.array([[NEC, CORRECT]] + [[NEC, WRONG]] * 3 + [[USE, CORRECT]] * 4, np.int32)
    hidden = np.zeros((8, 2, 2), np.float32)
    hidden[:, 0, 0] = 1.0            # state "prompt": logits = W[:, 0]
    hidden[:4, 1, 1] = 1.0           # state "after NEC": logits = W[:, 1]
    # state "after USE": zero hidden -> a fixed uniform step with no gradient; always unable.
    return jnp.asarray(hidden), jnp.asarray(targets), jnp.ones((8, 2), jnp.float32)


def _tree():
    sp = lambda rows, col: [(r, col, col + 1) for r in rows]
    nodes = [ArrayTreeNode(-1, spans=sp(range(4), 0)), ArrayTreeNode(-1, spans=sp(range(4, 8), 0))]
    nodes += [ArrayTreeNode(0, spans=sp([r], 1), leaf_outcome=OUTCOMES[r]) for r in range(4)]
    nodes += [ArrayTreeNode(1, spans=sp([r], 1), leaf_outcome=OUTCOMES[r]) for r in range(4, 8)]
    return RolloutTree(nodes)


def _p_nec(w_vd):
    return float(jax.nn.softmax(w_vd[:, 0])[NEC])


def _update(w_vd, adv_bt, lr=0.5):
    hidden, targets, mask = _batch()
    old = jax.lax.stop_gradient(token_logprobs(hidden, w_vd, targets))

    def loss(w):
        logp = token_logprobs(hidden, w, targets)
        total, denom, _ = policy_loss(logp, old, adv_bt, mask, eps_low=0.2, eps_high=0.2,
                                      agg="token_mean")
        return safe_divide(total, denom)

    return w_vd - lr * jax.grad(loss)(w_vd)


def test_grpo_lowers_the_necessary_step_and_portool_raises_it():
    # pi(NEC) = 0.5, pi(CORRECT | NEC) = 0.25: the necessary step is usually followed by -1.
    w_vd = jnp.array([[0.0, np.log(1 / 3)], [0.0, 0.0]], jnp.float32)
    p0 = _p_nec(w_vd)

    rewards = jnp.asarray(OUTCOMES, jnp.float32)
    a_traj = group_zscore(rewards, jnp.zeros(8, jnp.int32), 1)
    grpo_adv_bt = jnp.repeat(a_traj[:, None], 2, axis=1)
    p_grpo = _p_nec(_update(w_vd, grpo_adv_bt))

    tree = _tree()
    arrs = stack_trees([tree], max_nodes=10)
    r_qn, a_qn = jax.vmap(functools.partial(tree_advantages, gamma=0.95, fm_scale=0.25,
                                            w1=1.0, w2=1.0))(
        arrs.parent, arrs.leaf_outcome, arrs.fm_reward, valid_n=arrs.valid)
    portool_adv_bt = jnp.asarray(node_values_to_tokens([tree], a_qn, (8, 2)))
    p_portool = _p_nec(_update(w_vd, portool_adv_bt))

    # The mechanism: GRPO's trajectory-level advantages sum to a negative credit for NEC ...
    assert float(jnp.sum(a_traj[:4])) < 0
    # ... while the max-aggregated step reward ranks NEC (gamma * 1) above USE (0).
    np.testing.assert_allclose(np.asarray(r_qn)[0, :2], [0.95, 0.0], atol=1e-6)
    assert float(a_qn[0, 0]) > 0 > float(a_qn[0, 1])
    # The theorem: GRPO lowers pi(NEC), PORTool raises it.
    assert p_grpo < p0 - 1e-3, (p0, p_grpo)
    assert p_portool > p0 + 1e-3, (p0, p_portool)
