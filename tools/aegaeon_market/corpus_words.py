"""Word lists for the corpus generator (`corpus_gen`).

Plain data, written for this project. The lists are long on purpose: a
byte-level BPE with 8k tokens needs a few thousand distinct words to learn
merges that look like a real English tokenizer's.
"""

from __future__ import annotations


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


FIRST_NAMES = _words("""
Ada Alma Amir Anika Arlo Asha Ben Bianca Bruno Carla Cedric Chen Clara Dalia Dev Diego Dora
Eli Elena Emeka Esme Farah Felix Fiona Gabe Greta Hana Hugo Ines Ivan Jada Jonas Jude Kai Kamal
Keira Lars Leila Leon Lina Luca Maeve Malik Marta Mateo Mei Mila Nadia Nico Noor Oona Oscar Otto
Petra Priya Quinn Rafa Rhea Rosa Rowan Sami Sara Selma Soren Tara Theo Tomas Uma Vera Viktor Wren
Yara Yusuf Zane Zoe Agnes Basil Cyrus Delia Edgar Flora Gideon Hazel Iris Jasper Lionel Mabel
Nell Olive Percy Ruth Silas Tilda Ursula Walter Winnie Abel Bea Cora Dmitri Enzo Freya Gus Ida
""")

FAMILY_NAMES = _words("""
Abbott Achebe Alvarez Baker Barros Becker Bell Brennan Castillo Chandra Chow Costa Dahl Diaz
Dubois Duarte Eklund Farrow Fischer Fontaine Garcia Greer Haddad Hale Hartley Hoffman Ibarra
Ishikawa Jensen Joshi Kaur Keller Kowalski Larsen Lindqvist Lopez Lund Mahmoud Marsh Mendes
Moreau Murphy Nakamura Novak Okafor Olsen Ortiz Park Patel Pereira Quinlan Ramos Reyes Rossi
Saito Sandoval Schmidt Silva Sorensen Stone Tanaka Thornton Varga Vogel Walsh Weber Whitlock
Yilmaz Young Zhang Ziegler Brook Carver Dunmore Ellery Fairbairn Goodwin Holloway Ingram
""")

TOWN_HEADS = _words("""
Ash Bar Bel Black Bram Brook Cal Car Cold Corn Dal Dun East Elm Fair Fern Glen Green Hal Har
High Holl Ken King Lang Lin Long Mar Mill Mor New North Oak Pen Red Ros Sal Stan Stone Sum
Thorn Wal West Whit Wick Wil Win Wood
""")

TOWN_TAILS = _words("""
bury by caster combe cliff dale field ford gate ham haven hill holm hurst ley mere minster
mouth ridge stead stow ton vale wick worth
""")

THINGS = _words("""
apple bag bakery balcony ball bank basket bath beach bean bed bench bicycle bird blanket boat
book boot bottle bowl box bread bridge brush bucket building bus butter button cabinet cake
calendar camera candle car card carpet cart castle cat chair cheese chicken child church city
classroom clock cloud coat coffee coin computer corner cottage couch country cousin cup
curtain desk dinner dog door drawer dress drum egg engine envelope factory farm fence field
film fire fish flag floor flower forest fork fountain friend garden gate gift glass glove
hall hammer harbor hat highway hill hospital hotel house island jacket jar kettle key kitchen
ladder lake lamp lane laptop lawn leaf letter library lighthouse lunch map market meadow
meeting mirror morning mountain museum neighbor newspaper notebook ocean office orchard oven
painting palace pan paper park path pencil phone piano picture pillow plate platform pocket
pond post pot puzzle radio rain recipe river road roof room rope ruler sandwich school
scissors sea season shelf ship shirt shoe shop shower sink sister skirt sky song spoon
square stadium staircase station stone store storm street student sugar suitcase sun table
teacher telescope tent theater ticket tower town toy track train tree truck tunnel umbrella
valley van village violin wall wallet watch window wire workshop yard
""")

IDEAS = _words("""
account address advice agreement airport answer anniversary appointment argument attention
audience balance bargain battery benefit bill birthday border budget business cabinet
campaign career ceiling challenge chance chapter choice circle client climate coast
committee community company concert condition conversation council courage course
crowd culture customer damage deadline decision delivery department design detail
difference direction discount distance doctor engineer environment evening event evidence
exercise experience experiment explanation failure feature festival figure flight
foundation freedom future gallery habit harvest health history holiday honesty idea
industry interview invitation journey judge knowledge landscape language lesson level
machine manager material memory message method minute mission moment network noise
number opinion opportunity orchestra package parent passenger patience pattern payment
performance permission person plan planet pleasure poem policy population position
practice problem process product program project promise property purpose quality
question reason record region report request research result review reward rhythm
schedule science screen secret sense service session signal silence skill solution
source speech spirit stage standard statement story strategy strength structure subject
success summer surface surprise system task team technology temperature theory thought
tradition traffic training trouble truth university vacation value version victory
visitor voice volunteer weather website weekend wind witness world writer
""")

FOODS = _words("""
almonds apricots asparagus bacon bananas barley basil beans beetroot blueberries broccoli
cabbage carrots cauliflower celery cherries chickpeas chocolate cinnamon coconut cod
cornflour courgettes cream cucumber cumin dates dill dumplings figs flour garlic ginger
grapes hazelnuts honey leeks lemons lentils lettuce limes mangoes milk mint mushrooms
mustard noodles nutmeg oats olives onions oranges oregano paprika parsley pasta peaches
pears peas pepper pineapple plums potatoes pumpkin raisins rice rosemary saffron salmon
salt sesame shallots spinach squash strawberries thyme tofu tomatoes turmeric vinegar
walnuts yogurt
""")

ADJECTIVES = _words("""
able absent active afraid ancient angry anxious awkward bitter blue bold bored brave bright
brief broad broken busy calm careful cheap cheerful clean clever close cold comfortable
common complex cool crisp crowded curious damp dark dear deep delicate dense dirty distant
dry dull eager early easy elegant empty enormous equal exact excited expensive faint fair
familiar famous fancy fast fierce fine firm flat fresh friendly frozen full funny gentle
glad golden good grand grateful gray great green grumpy happy hard heavy helpful hidden
high hollow honest hot huge humble hungry icy important narrow nervous new nice noisy odd
old open orange ordinary pale patient perfect plain pleasant polite poor popular precious
pretty proud purple quick quiet rapid rare raw ready real red rich rough round rude rusty
sad safe salty sandy sharp shiny short shy silent silly simple slow small smooth soft
solid sour spare special spicy steady steep sticky strange strict strong sudden sunny
sweet swift tall tender thick thin tidy tiny tired tough tricky useful vast warm weak
wealthy wet whole wide wild windy wise wooden worried yellow young modern digital
practical reliable generous thoughtful stubborn cautious ambitious restless mysterious
""")

ADVERBS = _words("""
almost already always barely briefly carefully certainly clearly closely easily eventually
finally firmly frankly gently gladly gradually happily honestly immediately kindly lately
loudly mostly nearly neatly normally occasionally often patiently perhaps politely quickly
quietly rarely really recently regularly roughly sadly seldom simply slowly softly soon
sometimes steadily suddenly surely swiftly usually warmly weekly yesterday tomorrow
""")

# base, past, -ing; regular verbs get their forms from `corpus_gen.inflect`.
IRREGULAR_VERBS: tuple[tuple[str, str, str], ...] = (
    ("begin", "began", "beginning"), ("bring", "brought", "bringing"),
    ("build", "built", "building"), ("buy", "bought", "buying"), ("catch", "caught", "catching"),
    ("choose", "chose", "choosing"), ("come", "came", "coming"), ("cut", "cut", "cutting"),
    ("draw", "drew", "drawing"), ("drink", "drank", "drinking"), ("drive", "drove", "driving"),
    ("eat", "ate", "eating"), ("fall", "fell", "falling"), ("feel", "felt", "feeling"),
    ("find", "found", "finding"), ("fly", "flew", "flying"), ("forget", "forgot", "forgetting"),
    ("get", "got", "getting"), ("give", "gave", "giving"), ("go", "went", "going"),
    ("grow", "grew", "growing"), ("hear", "heard", "hearing"), ("hold", "held", "holding"),
    ("keep", "kept", "keeping"), ("know", "knew", "knowing"), ("leave", "left", "leaving"),
    ("lend", "lent", "lending"), ("lose", "lost", "losing"), ("make", "made", "making"),
    ("meet", "met", "meeting"), ("pay", "paid", "paying"), ("put", "put", "putting"),
    ("read", "read", "reading"), ("ride", "rode", "riding"), ("ring", "rang", "ringing"),
    ("run", "ran", "running"), ("say", "said", "saying"), ("see", "saw", "seeing"),
    ("sell", "sold", "selling"), ("send", "sent", "sending"), ("shake", "shook", "shaking"),
    ("sing", "sang", "singing"), ("sit", "sat", "sitting"), ("sleep", "slept", "sleeping"),
    ("speak", "spoke", "speaking"), ("spend", "spent", "spending"), ("stand", "stood", "standing"),
    ("swim", "swam", "swimming"), ("take", "took", "taking"), ("teach", "taught", "teaching"),
    ("tell", "told", "telling"), ("think", "thought", "thinking"), ("throw", "threw", "throwing"),
    ("understand", "understood", "understanding"), ("wake", "woke", "waking"),
    ("wear", "wore", "wearing"), ("win", "won", "winning"), ("write", "wrote", "writing"),
    ("stop", "stopped", "stopping"), ("plan", "planned", "planning"), ("shop", "shopped",
    "shopping"), ("drop", "dropped", "dropping"), ("grab", "grabbed", "grabbing"),
)

REGULAR_VERBS = _words("""
accept add admire agree allow answer appear arrange arrive ask attach bake borrow brush
call carry change check clean climb close collect compare complain count cover crash cross
deliver describe destroy discover divide dress enjoy explain fill finish fix fold follow
gather greet guess hand hang help hope hunt imagine improve invite join jump kick knock
laugh learn lift like listen live load look love mark measure mend mix move notice obey
offer open order paint park pass pick plant play point polish pour prefer prepare press
print promise protect pull push reach receive record remember repair repeat reply report
rescue rest return rush sail save search serve share sign smile sort start stay stir
suggest support surprise talk taste thank touch travel treat try turn use visit wait walk
want warm wash watch water wave whisper wish wonder work worry wrap yawn
""")

JOBS = _words("""
architect baker carpenter chemist cook dentist designer driver editor electrician farmer
firefighter gardener guide librarian mechanic musician nurse painter pharmacist photographer
pilot plumber porter reporter sailor scientist tailor translator vet
""")

ANIMALS = _words("""
badger beaver crow deer donkey duck eagle ferret fox frog goat goose hedgehog heron horse
lizard mole otter owl parrot pigeon rabbit raven seal sheep snail sparrow squirrel swan toad
tortoise turtle whale wolf
""")

COLORS = _words("red blue green yellow orange purple brown black white gray silver golden pink")

WEATHER = (
    "it rained all afternoon", "the sky cleared after lunch", "a cold wind came off the hills",
    "fog sat low over the river", "the sun was warm on the stones", "snow fell in thick flakes",
    "the air smelled of wet grass", "thunder rolled somewhere far away",
    "the evening was still and mild", "frost covered the car windows",
)

FEELINGS = _words("""
calm cheerful confused curious delighted disappointed embarrassed excited grateful hopeful
irritated lonely nervous proud relieved restless surprised thoughtful tired uneasy
""")

# (long name, short name, smallest, largest) quantity for recipes.
UNITS: tuple[tuple[str, str, int, int], ...] = (
    ("grams", "g", 10, 500), ("kilograms", "kg", 1, 3), ("millilitres", "ml", 20, 750),
    ("litres", "l", 1, 2), ("cups", "cups", 1, 4), ("teaspoons", "tsp", 1, 3),
    ("tablespoons", "tbsp", 1, 5),
)

WEEKDAYS = _words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
MONTHS = _words(
    "January February March April May June July August September October November December"
)

# snake_case parts for the code snippets.
CODE_VERBS = _words("""
get set load save parse build read write find count merge split sort check update reset
compute render fetch send open close format validate normalize encode decode
""")
CODE_NOUNS = _words("""
user item order config path name value total price record line row column file token
buffer cache index queue message result score entry block batch table report event
""")

NON_ASCII = (
    "café", "naïve", "résumé", "jalapeño", "crème brûlée", "über", "façade", "Zoë",
    "São Paulo", "Zürich", "Kraków", "Ångström", "fiancée", "piñata", "smörgåsbord",
    "20 °C", "€12.50", "£7", "¥300", "— ", "…", "“quoted”", "‘single’", "→", "✓", "☕",
    "日本", "München", "Ελλάδα", "Россия", "½ cup", "3×4", "±2%",
)
