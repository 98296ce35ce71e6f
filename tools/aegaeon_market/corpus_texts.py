"""Sentence and snippet templates for the corpus generator (`corpus_gen`).

Slots in braces are filled by `corpus_gen.Slots`; a trailing digit makes a
second, independent value of the same kind (``{name2}``).
"""

from __future__ import annotations

STORY: tuple[str, ...] = (
    "{name} {past} the {thing} before breakfast and then went back to bed.",
    "on {weekday} morning {name} took the {time} train to {town}.",
    "{weather}, so {name} stayed at home and {past} {a_thing}.",
    "the {adj} {thing} by the door belonged to {name}'s cousin.",
    "nobody in {town} had ever seen such {a_adj} {animal}.",
    "after lunch, {name} and {name2} walked along the {thing} and talked about {idea}.",
    "{name} felt {feeling} when the {job} said the {thing} was too {adj}.",
    "it took {num} minutes to find the {things}, which were under the {thing2}.",
    "{name} {adverb} {past} the {adj} {thing} and put it on the shelf.",
    "the {job} from {town} was {ing} {a_thing} when the phone rang.",
    "we bought {num} {things} at the market for {price} pounds.",
    "her grandmother still {third} {food} every {weekday}.",
    "the {idea} meeting was moved to {time} because the {job} was late.",
    "outside, {a_adj} {animal} watched them from the {thing}.",
    "{name} had never been {adverb} {feeling} about {a_thing} before.",
    "in {month} the {thing} by the river turns {color}.",
    "the children {past} {things} all afternoon and came home {adj} and {adj2}.",
    "{name} wrote down the {idea} in a {adj} notebook so she would not forget it.",
    "by {time} the {thing} was {adj} and the street was {adj2}.",
    "everyone agreed that the {idea} was {adj}, except {name}.",
    "the bus to {town} was {num} minutes late again.",
    "{name2} laughed, picked up the {thing}, and {past} it across the room.",
    "there is a small {thing} near the {thing2} where people {verb} on {weekday}s.",
    "last {month}, {full} opened a {adj} shop selling {things} and {things2}.",
    "they ordered {intl} and two glasses of water.",
    "the report said that {pct} of visitors to {town} came back the next year.",
    "{name} {third} that the {idea} is more important than the {idea2}.",
    "if the {thing} is {adj}, you can {verb} it later.",
    "the old {job} in {town} knew every {thing} by name.",
    "when {name} finally {past} the {thing}, it was already dark.",
    "it is {adj} to {verb} a {thing} without asking first.",
    "the {animal} ran across the {thing} and disappeared into the hedge.",
    "for {num} years the {thing} had stood in the same corner of the {thing2}.",
    "{name} {adverb} remembered the smell of {food} in her aunt's kitchen.",
    "the museum in {town} has a {adj} collection of {things}.",
    "nobody knew why the {thing} was {color}, but everyone had a theory.",
    "{full} was born in {town} on {day} {month} {year}.",
    "in the end, {name} chose the {adj} one, and nobody was surprised.",
)

LINES: tuple[str, ...] = (
    "have you seen my {thing}?",
    "I think I left it in the {thing}.",
    "what time does the {thing} open on {weekday}?",
    "at {time}, I think, but check the sign.",
    "could you {verb} the {thing} for me?",
    "of course, give me {num} minutes.",
    "I don't know, {name}. It seems {adj} to me.",
    "are you coming to {town} tomorrow?",
    "only if the train is running. Last week it was {num} minutes late.",
    "that's the most {adj} {thing} I have ever seen!",
    "did you remember to {verb} the {things}?",
    "sorry, I completely forgot. I'll do it after dinner.",
    "how much was the {thing}?",
    "{price} euros, which is not bad at all.",
    "why is the {thing} {color}?",
    "ask the {job}. I just work here.",
    "we should {verb} before it gets dark.",
    "fine, but I'm bringing the {thing}.",
    "is it true that you {past} {a_thing}?",
    "yes, and I would do it again.",
    "what do you think about the {idea}?",
    "honestly? I think it is {adj}, but it might work.",
)

QUESTIONS: tuple[str, ...] = (
    "how do I {verb} {a_thing}?",
    "what is the best way to {verb} {things} at home?",
    "can you explain what {a_job} does all day?",
    "I have {num} {food} left. What can I cook with them?",
    "why does my {thing} make a strange noise in the morning?",
    "write a short note inviting {name} to a {adj} party on {weekday}.",
    "summarize the history of the {thing} in {town} in two sentences.",
    "what is {num} times {num2}?",
    "give me three ideas for a {adj} weekend in {town}.",
    "how long should I {verb} {food} for?",
    "translate \u201cthe {adj} {thing}\u201d into simpler words.",
    "is it safe to leave {a_thing} outside when {weather}?",
)

OPENERS: tuple[str, ...] = (
    "good question.", "sure, here is a simple way to do it.", "here is what I would suggest.",
    "it depends a little on the {thing}, but usually:", "happy to help.",
    "the short answer is yes, with some care.",
)

STEPS: tuple[str, ...] = (
    "first, {verb} the {thing} and make sure it is {adj}.",
    "next, check that the {things} are not too {adj}.",
    "then wait about {num} minutes.",
    "if it still looks {adj}, {verb} it again {adverb}.",
    "finally, put everything back in the {thing}.",
    "ask {a_job} if you are not sure.",
    "keep a note of the time, for example {time}.",
    "it usually costs around {price} dollars.",
    "most people find that {pct} is enough.",
)

RECIPE_STEPS: tuple[str, ...] = (
    "preheat the oven to {temp} \u00b0C.",
    "chop the {food} and set it aside.",
    "heat a little oil in a pan and add the {food}.",
    "stir in the {food} and cook for {num} minutes.",
    "season with salt, pepper and a pinch of {food}.",
    "whisk the {food} with the {food2} until smooth.",
    "bake for {num} minutes, until golden.",
    "leave to cool before slicing.",
    "serve warm with {food} on the side.",
    "cover and let it rest for {num} minutes.",
)

NUMBER_LINES: tuple[str, ...] = (
    "train {big} leaves {town} at {time} and arrives in {town2} at {time2}, platform {num}.",
    "order #{big}: {num} x {thing} at ${price} each.",
    "{weekday}, {day} {month} {year}: {num} visitors, {pct} more than last year.",
    "the {thing} weighs {num} kg and measures {num2} by {num3} cm.",
    "room {num}, floor {num2}, {town} Road {big}.",
    "population of {town} in {year}: {big}.",
    "meeting at {time} on {weekday} {day} {month}, room {num}.",
    "temperature: {num} \u00b0C at {time}, {num2} \u00b0C at {time2}.",
    "invoice {big} due on {day}/{num}/{year}, total \u20ac{price}.",
    "{name},{full},{town},{big},{price}",
    "score: {num} to {num2} after {num3} minutes.",
)

LETTER: tuple[str, ...] = (
    "thank you for the {adj} {thing}; it arrived on {weekday}.",
    "I hope the weather in {town} is better than here, where {weather}.",
    "the {job} says the {thing} will be ready by {day} {month}.",
    "could we meet at {time} instead of {time2}?",
    "please bring the {things} if you still have them.",
    "I am sorry I missed your call about the {idea}.",
    "we are {adverb} {feeling} about the news.",
    "let me know if you need anything else for the {idea}.",
)

CODE: tuple[str, ...] = (
    'def {cverb}_{cnoun}s({cnoun}s: list[str]) -> int:\n'
    '    """{cverb} the {cnoun}s and return how many were kept."""\n'
    '    kept = 0\n'
    '    for {cnoun} in {cnoun}s:\n'
    '        if {cnoun}.startswith("{cnoun2}"):\n'
    '            kept += 1\n'
    '    return kept',
    'class {cap_thing}Store:\n'
    '    def __init__(self, path: str) -> None:\n'
    '        self.path = path\n'
    '        self.{cnoun}s: dict[str, int] = {{}}\n\n'
    '    def {cverb}(self, key: str, value: int = {num}) -> None:\n'
    '        self.{cnoun}s[key] = value',
    '{{"{cnoun}": "{thing}", "{cnoun2}": {num}, "tags": ["{adj}", "{color}"], "ok": true}}',
    '$ git commit -m "{cverb} {cnoun} handling in {cnoun2}.py"\n$ ls -la /home/{name}/{thing}',
    'for i in range({num}):\n    total += {cnoun}s[i] * {num2}\nprint(f"total: {{total}}")',
    'SELECT {cnoun}, COUNT(*) FROM {cnoun2}s WHERE {cnoun} > {num} GROUP BY {cnoun};',
    'if {cnoun} is None:\n    raise ValueError("missing {cnoun} for {cnoun2} {num}")\n'
    'return {cverb}_{cnoun}({cnoun}, limit={num2})',
    '# {cverb} every {cnoun} before the {cnoun2}s are written\n'
    '{cnoun}s = sorted({cnoun}s, key=lambda x: x.{cnoun2})\n'
    'with open("{cnoun}s.txt", "w") as f:\n    f.write("\\n".join({cnoun}s))',
)
