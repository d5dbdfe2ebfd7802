"""Write edit_requests.jsonl: four chat requests that ask the default model to repeat or lightly edit a paragraph (the
kind of request n-gram drafts serve: the answer quotes the prompt). Run: python make_edit_requests.py"""

import json

from pagedllm import LLM

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening from Monday to Friday. On Saturdays "
    "it opens at ten and closes at four. It is closed on Sundays and on public holidays. Members may borrow up to "
    "eight books at a time for three weeks, and may renew them twice online or at the front desk.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the warm water and stir until a "
    "rough dough forms. Knead it on a floured table for ten minutes, until it is smooth. Leave it covered in a warm "
    "place for an hour, shape it into a loaf, and bake it for forty minutes.",
    "Our team meets every Tuesday at two in the afternoon in the small room on the third floor. Each person says "
    "what they finished last week, what they plan to do this week, and what is blocking them. The meeting lasts "
    "no more than thirty minutes, and notes are shared with everyone by the end of the day.",
    "The train to the coast leaves the central station every hour, on the hour, from six in the morning until ten "
    "at night. The journey takes two hours and ten minutes. Tickets can be bought at the station, on the train, "
    "or in advance on the website, where they are a little cheaper.",
]
ASKS = ["Repeat the following text exactly, word for word:\n\n{}",
        "Rewrite the following text in the past tense, changing nothing else:\n\n{}",
        "Copy the following text and put each sentence on its own line:\n\n{}",
        "Fix any mistakes in the following text and return the whole text:\n\n{}"]

if __name__ == "__main__":
    tokenizer = LLM(num_blocks=16).get_tokenizer()
    with open("edit_requests.jsonl", "w") as f:
        for ask, paragraph in zip(ASKS, PARAGRAPHS):
            messages = [{"role": "user", "content": ask.format(paragraph)}]
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
            f.write(json.dumps({"prompt_token_ids": ids, "output_len": 160}) + "\n")
