"""The chunked head (`loss_chunk`): the causal-LM loss without the whole sequence's logits.

The model's own head computes the logits of every token at once (bf16, then fp32 for the loss) and
keeps them, with their gradient, through its backward: 16 bytes per token per vocabulary entry, 40 GB
for 16384 tokens of a 152k vocabulary, more than everything else of a streamed step. The chunked head
runs the same modules and kernels on `loss_chunk` tokens at a time, each chunk under non-reentrant
checkpointing, so one chunk's logits are alive at a time (they are recomputed in backward): the
lm_head, the family's final logit soft-capping, the fp32 log-softmax and the pick of each token's
log-probability (`nll_loss` without reduction, which is how cross-entropy computes it). The mean over
the predicted tokens is then the model's own reduction (`nll_loss` over one log-probability per
token), in its order, so every loss and gradient bit is the model's wherever a token's row of logits
does not depend on how many rows the matmul computes (so on the CPU: tests/engine/test_head.py) and the
lm_head is frozen, as in QLoRA (its weight gradient would add the chunks' partial sums). It is a
setting of what is computed all the same, shared by every method of a run, so the gate holds even
where a kernel does depend on it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # label of a position without a next token to predict (as the model's loss)


def softcap_of(model: nn.Module) -> float | None:
    """The family's final logit soft-capping (Gemma), None where it has none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "final_logit_softcapping", None)


def _token_losses(head: nn.Module, softcap: float | None, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each token's cross-entropy (0 where ignored): the model's head arithmetic on `hidden` rows."""
    logits = head(hidden)
    if softcap is not None:  # as the model does it, in the logits' dtype
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    logp = F.log_softmax(logits.float(), dim=-1)
    return F.nll_loss(logp, labels, ignore_index=IGNORE_INDEX, reduction="none")


def chunked_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, softcap: float | None,
                 chunk: int, num_items_in_batch=None) -> torch.Tensor:
    """The causal-LM loss of `hidden` (the final norm's output, batch x seq x hidden) against `labels`
    (batch x seq; position t predicts label t + 1), `chunk` tokens at a time.

    Args:
        num_items_in_batch: the count to divide the summed loss by, as the model's loss takes it
            (default: the mean over the predicted tokens).
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if len(rows) <= chunk:  # one chunk: nothing to drop before the backward
        losses = _token_losses(head, softcap, rows, shifted)
    else:
        losses = torch.cat([checkpoint(_token_losses, head, softcap, h, y, use_reentrant=False)
                            for h, y in zip(torch.split(rows, chunk), torch.split(shifted, chunk))])
    # the model's reduction over one log-probability per token: -(-loss) is the log-probability, exactly
    picked = torch.where(shifted == IGNORE_INDEX, IGNORE_INDEX, 0)
    if num_items_in_batch is None:
        return F.nll_loss((-losses).unsqueeze(1), picked, ignore_index=IGNORE_INDEX, reduction="mean")
    total = F.nll_loss((-losses).unsqueeze(1), picked, ignore_index=IGNORE_INDEX, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def use_chunked_loss(model: nn.Module, chunk: int) -> None:
    """Make `model`'s forward (a Hugging Face causal LM) compute its training loss with `chunked_loss`.

    With labels, the forward runs the model's decoder as the model's own forward does and returns the
    loss without logits; without labels (inference) it is the model's own forward.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    own = model.forward
    decoder, head, softcap = model.get_decoder(), model.get_output_embeddings(), softcap_of(model)

    def forward(input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        if labels is None:
            return own(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       inputs_embeds=inputs_embeds, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        loss = chunked_loss(out.last_hidden_state, labels, head, softcap, chunk, num_items)
        return CausalLMOutputWithPast(loss=loss)

    model.forward = forward
