"""The repeating workload of speculative decoding's benchmark: a passage of about 300 tokens with a few spelling
mistakes, then "Repeat the passage above, correcting any spelling mistakes:", through the default model's chat
template as text (so every server reads the same tokens through /v1/completions)."""

from __future__ import annotations

SENTENCES = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind.",
    "Every evening the keeper climbed the spiral stairs to light the great lamp before the ships came home.",
    "Fishermen in the village said they could see the beam from twenty miles out on a clear night.",
    "In winter the storms were so strong that waves broke over the rocks and reached the lower windows.",
    "The keeper kept a careful log of the weather, the ships that passed, and every repair he made.",
    "He beleived that a lighthouse was only as good as the person who looked after it.",
    "His daughter learned to trim the wicks and polish the lenses untill they shone like glass.",
    "Visitors sometimes arrived by boat in the summer, asking to climb to the top and see the view.",
    "From the gallery you could watch seabirds wheel above the water and seals rest on the rocks below.",
    "The government decided to replace the lamp with an automatic light that needed no keeper at all.",
    "On the last night he lit the lamp one final time and wrote a long entry in the log.",
    "The village held a celebration in his honour, with music, bread, and fish cooked over open fires.",
    "Years later the lighthouse became a small museum wich told the story of the keepers and their families.",
    "Children who visit can still read the old logs and imagine the storms that once shook the tower.",
    "A seperate room shows the tools they used, from brass oil cans to heavy iron keys.",
    "The museum guide says the keeper never missed a single night in forty years of service.",
    "It is definately one of the most popular places to visit along that stretch of coast.",
    "Some people say that on stormy nights a faint light still glows in the empty lamp room.",
    "Scientists who studied the tower found that its walls were built to bend slightly in the wind.",
    "The stone came from a quarry across the bay and was carried over by boat, one block at a time.",
]
INSTRUCTION = "Repeat the passage above, correcting any spelling mistakes:"


def repeat_prompts(n: int) -> list[str]:
    """``n`` different passages of 13 sentences (about 300 tokens), each asked to be repeated, as chat text."""
    from wsgi_infer.engine.loading.model_loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    texts = []
    for i in range(n):
        passage = " ".join(SENTENCES[(i * 3 + j) % len(SENTENCES)] for j in range(13))
        conversation = [{"role": "user", "content": f"{passage}\n\n{INSTRUCTION}"}]
        texts.append(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))
    return texts
