"""The prompt/response boundary in token ids (issue 24), written here until dflash.py's restructure lands; then
chat_sample below replaces dflash.py's and this file goes."""
import dflash


def chat_sample(messages, tokenizer, kw, eos, where):
    """(ids, mask) of a conversation, with the ids inference gives: each assistant turn k is tokenized on its own,
    after the conversation before it, never merged with the end of its generation prompt (whole-string tokenization
    can merge the "\\n" that ends "<|im_start|>assistant\\n" with a code answer's indentation, a token the target
    never produces there). Mask 1 exactly on what the target generates for each turn: from the end of its generation
    prompt through the eos token that stops generation. Turns are located inside the full rendering, never by
    rendering messages[:k+1] alone: Qwen3-style templates render the assistant turn after the last user message with
    a think block and earlier ones without."""
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731

    def render(msgs, gen=False):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
        except Exception as e:  # the template's raise_exception, or a message it cannot render
            raise dflash.DFlashError(f"{where}: the chat template fails on the first {len(msgs)} messages: "
                                     f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None

    def ambiguous(k, why):
        return dflash.DFlashError(f"{where}: assistant turn {k}: {why}, so its loss mask is ambiguous; split the "
                                  f"conversation into one sample per assistant turn")

    full = render(messages)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    contexts = [render(messages[:k]) for k in turns] + [full]  # each must be a prefix of the full rendering
    ids, mask, pos = [], [], 0  # pos: how much of `full` is tokenized

    def add(text, m):
        t = encode(text)
        ids.extend(t)
        mask.extend([m] * len(t))
        return t

    for i, k in enumerate(turns):
        context, gen = contexts[i], render(messages[:k], gen=True)
        if not full.startswith(context):
            raise ambiguous(k, "the template renders the turns before it differently inside the whole conversation")
        # the turn starts where the generation prompt ends. A template that renders an earlier turn without what
        # its prompt adds (an empty think block when thinking is off) starts it at the last token boundary of the
        # prompt that the rendering shares (so an answer starting with "<" does not start inside "<think>").
        start = next((j for j, (a, b) in enumerate(zip(gen, full)) if a != b), min(len(gen), len(full)))
        if start < len(gen):
            gen_ids = encode(gen)
            while start > len(context):
                head = encode(gen[:start])
                if head == gen_ids[:len(head)]:
                    break
                start -= 1
        if start < len(context):
            raise ambiguous(k, "the generation prompt rewrites the conversation before it")
        limit = len(contexts[i + 1])  # the end of the rendered turn: the end-of-turn token is searched before it
        add(full[pos:start], 0)
        turn = encode(full[start:limit])
        end = next((j + 1 for j, t in enumerate(turn) if t in eos), None)
        if end is not None:
            ids.extend(turn)
            mask.extend([1] * end + [0] * (len(turn) - end))
        else:  # no end-of-turn token: the turn's own rendering ends it, if that is part of the whole
            own = render(messages[:k + 1])
            if not full.startswith(own) or len(own) <= start:
                raise ambiguous(k, f"no eos token {sorted(eos)} ends it and the template renders it differently "
                                   f"as the last turn (pass the target's eos ids)")
            add(full[start:len(own)], 1)
            add(full[len(own):limit], 0)
        pos = limit
    add(full[pos:], 0)
    return ids, mask
