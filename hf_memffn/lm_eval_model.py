"""lm-eval-harness model `memffn`: the stock `hf` model, plus MemoryLLM / FlexMemoryLLM in token-lookup-table mode.

Every checkpoint of this package already works with the stock model
(`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True`). This wrapper adds three `model_args`:

* `token_lookup=TABLE_DIR`: after loading, read the FFNs on X0 from the table exported to TABLE_DIR
  (`hf-memffn export-tols`; a Hub repo id holding the table works too) instead of computing them;
* `token_lookup_placement=gpu|cpu|disk` (default: gpu when the model runs on CUDA, else cpu);
* `drop_memory_ffn=True`: free the FFN weights on X0 once the table is loaded.

Its `loglikelihood_rolling` (perplexity tasks) scores each document after exactly one `<s>`: the stock model puts
`<s>` in front of the first window on top of the one the tokenizer adds.

From the command line (registers the model, then runs the lm-eval CLI with the same arguments):

    python -m hf_memffn.lm_eval_model --model memffn \
        --model_args pretrained=DIR,trust_remote_code=True,token_lookup=DIR --tasks hellaswag,piqa

From Python: `import hf_memffn.lm_eval_model` and pass `model="memffn"` to `lm_eval.simple_evaluate`.
"""

from __future__ import annotations

from .cli_args import install_hint

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ModuleNotFoundError as error:
    if (error.name or "").split(".")[0] != "lm_eval":
        raise
    message = f"hf_memffn.lm_eval_model needs lm-eval-harness, which is not installed: {install_hint('lm_eval')}"
    if __name__ == "__main__":  # `python -m hf_memffn.lm_eval_model ...`: one line, as the package's commands give
        raise SystemExit(message) from None
    raise ModuleNotFoundError(message, name=error.name) from error

from .configuration_memffn import check_choice
from .serving import default_placement, local_table_dir, placement_problem, table_folder_problem
from .token_lookup import PLACEMENTS

MODEL_NAME = "memffn"


def pretrained_config(kwargs: dict):
    """The config of the model `HFLM` is about to load from `kwargs` (read alone, without the weights), or the config
    of a model given already loaded; None without `pretrained`."""
    pretrained = kwargs.get("pretrained")
    if pretrained is None:
        return None
    if not isinstance(pretrained, str):
        return pretrained.config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(pretrained, revision=str(kwargs.get("revision") or "main"),
                                      subfolder=kwargs.get("subfolder") or "", gguf_file=kwargs.get("gguf_file"),
                                      trust_remote_code=kwargs["trust_remote_code"])


@register_model(MODEL_NAME)
class MemFFNLM(HFLM):
    """`HFLM` that can switch a MemoryLLM / FlexMemoryLLM to its token lookup table after loading."""

    def __init__(self, token_lookup: str | None = None, token_lookup_placement: str | None = None,
                 drop_memory_ffn: bool = False, **kwargs):
        kwargs.setdefault("trust_remote_code", True)
        # (the lookup arguments are checked, and the table found, before the model is loaded; lm-eval's `model_args`
        # parser turns only true/false into booleans, so a word such as `no` arrives here as a string)
        check_choice("drop_memory_ffn", drop_memory_ffn, (True, False))
        if token_lookup is None:
            if token_lookup_placement is not None or drop_memory_ffn:
                raise ValueError("token_lookup_placement / drop_memory_ffn need token_lookup=TABLE_DIR")
        else:
            if token_lookup_placement is not None:
                check_choice("token_lookup_placement", token_lookup_placement, PLACEMENTS)
            if (problem := placement_problem(token_lookup_placement)) is not None:
                raise ValueError(f"token_lookup_placement={token_lookup_placement!r}: {problem}")
            config = pretrained_config(kwargs)
            if config is not None and getattr(config, "token_memory_size", None) is None:
                name = (getattr(config, "architectures", None) or [type(config).__name__])[0]
                raise ValueError(
                    f"token_lookup={token_lookup!r}: {name} has no token lookup tables "
                    "(only MemoryLLM and FlexMemoryLLM have FFNs on the token embeddings)"
                )
            # (a table in the evaluated Hub repo itself is read at the evaluated revision)
            revision = kwargs.get("revision") if str(token_lookup) == str(kwargs.get("pretrained")) else None
            table_dir = local_table_dir(str(token_lookup), revision)
            folder_problem = table_folder_problem(table_dir, {} if config is None else config.to_dict())
            if folder_problem is not None:
                raise ValueError(f"token_lookup={token_lookup!r}: {folder_problem}")
        self.token_lookup_path = token_lookup  # (read by `_create_model`, which `HFLM.__init__` calls)
        super().__init__(**kwargs)
        if token_lookup is None:
            return
        model = self._model
        model.load_tols(table_dir, placement=token_lookup_placement or default_placement(model),
                        drop_memory_ffn=bool(drop_memory_ffn))

    def _create_model(self, pretrained: str, peft: str | None = None, delta: str | None = None,
                      revision: str | None = "main", trust_remote_code: bool | None = False, **kwargs) -> None:
        """`HFLM._create_model`, but a PEFT adapter (`peft=ADAPTER`) keeps a padded vocabulary: `HFLM` resized the
        token embedding to the tokenizer's length, which drops the rows beyond the tokenizer's (the softmax then runs
        over fewer logits, an adapter that saved the embedding or the head no longer fits, and a table exported from
        the model was refused for its vocab_size once everything had loaded). The embedding grows, as in `HFLM`, for
        the tokens an adapter added. With `token_lookup`, an adapter that the table cannot be read under is refused
        before the weights are loaded."""
        if peft and not delta:
            if self.token_lookup_path is not None:
                self._check_adapter_takes_the_table(peft, revision, trust_remote_code)
            super()._create_model(pretrained, revision=revision, trust_remote_code=trust_remote_code, **kwargs)
            from peft import PeftModel

            if len(self.tokenizer) > self._model.get_input_embeddings().weight.shape[0]:
                self._model.resize_token_embeddings(len(self.tokenizer))
            self._model = PeftModel.from_pretrained(self._model, peft, revision=revision)
            return
        super()._create_model(pretrained, peft=peft, delta=delta, revision=revision,
                              trust_remote_code=trust_remote_code, **kwargs)

    def _check_adapter_takes_the_table(self, peft: str, revision: str | None, trust_remote_code) -> None:
        """Refuse, before the weights load, an adapter under which `token_lookup` cannot be read: one that adds
        tokens (the table holds the model's vocabulary only) or that changes the token embedding or the FFNs on X0
        (tried on the model built on the meta device, without its weights)."""
        import torch
        from peft import PeftConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        from .token_lookup import refuse_table_input_adapters

        prefix = f"token_lookup={self.token_lookup_path!r} with peft={peft!r}"
        if len(self.tokenizer) > self.config.vocab_size:
            raise ValueError(f"{prefix}: the tokenizer has {len(self.tokenizer)} tokens, more than the model's "
                             f"vocab_size={self.config.vocab_size}, and the table holds the model's tokens only; merge "
                             "the adapter into the model (merge_and_unload), save it and export its table")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, trust_remote_code=trust_remote_code)
        try:
            refuse_table_input_adapters(get_peft_model(skeleton, PeftConfig.from_pretrained(peft, revision=revision)))
        except ValueError as error:
            raise ValueError(f"{prefix}: {error}") from None

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """`HFLM.loglikelihood_rolling` with the documents encoded without special tokens.

        `HFLM` puts `prefix_token_id` (`<s>`) in front of the first window itself, and its `tok_encode` keeps the
        tokenizer's default of adding `<s>` (these checkpoints' tokenizers do, as Llama's do): the stock model scores
        `<s> <s> text`. With `add_bos_token=False` for this call only, the windows start with exactly one `<s>`, and
        `loglikelihood` / `generate_until` keep the tokenizer's `<s>`.
        """
        add_bos_token, self.add_bos_token = self.add_bos_token, False
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self.add_bos_token = add_bos_token


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
