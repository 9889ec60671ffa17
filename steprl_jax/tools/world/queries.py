"""Query templates for the tool world, each with a reference answer and a reference plan.

A template answers its question twice, by two independent routes: `generate` reads the
world's tables directly (the reference answer, and the arguments of every planned call),
while `derive` recomputes the answer from what the tools return when the plan is executed.
Tests check that the two agree for every generated query.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import random
from typing import Any, Callable

from steprl_jax.tools.protocol import ToolCall
from steprl_jax.tools.world.generate import (
    NEWS_TOPICS, EpisodeContext, World, current_temperature, generate_world, great_circle_km, local_datetime,
    random_context)
from steprl_jax.tools.world.tools import TERMINAL_TOOL, flight_summary, standings, trading_days

DOMAINS = ("weather", "sports", "geo", "knowledge", "clock", "news", "flights", "stocks")


class Skip(Exception):
    """This template does not fit this world and context; the generator tries another draw."""


def number(x: float) -> str:
    """`12`, `12.5`, `-3.25`: how numbers appear in reference answers."""
    x = round(float(x), 2)
    return str(int(x)) if x == int(x) else f"{x:g}"


@dataclasses.dataclass(frozen=True)
class Query:
    id: str
    template: str
    domains: tuple[str, ...]
    question: str
    context: EpisodeContext
    plan: tuple[tuple[ToolCall, ...], ...]  # steps of independent calls; the last step is response_gen
    answer: str
    time_dependent: bool
    location_dependent: bool
    held_out: bool
    world_seed: int

    @property
    def tool_steps(self) -> int:
        return len(self.plan) - 1

    @property
    def tool_calls(self) -> int:
        return sum(len(step) for step in self.plan[:-1])

    def to_json(self) -> dict:
        return {"id": self.id, "template": self.template, "domains": list(self.domains), "question": self.question,
                "context": self.context.to_json(),
                "plan": [[call.to_json() for call in step] for step in self.plan], "answer": self.answer,
                "time_dependent": self.time_dependent, "location_dependent": self.location_dependent,
                "held_out": self.held_out, "world_seed": self.world_seed}

    @classmethod
    def from_json(cls, r: dict) -> "Query":
        plan = tuple(tuple(ToolCall(c["name"], c["arguments"]) for c in step) for step in r["plan"])
        return cls(r["id"], r["template"], tuple(r["domains"]), r["question"], EpisodeContext.from_json(r["context"]),
                   plan, r["answer"], r["time_dependent"], r["location_dependent"], r["held_out"], r["world_seed"])


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    domains: tuple[str, ...]
    time_dependent: bool
    location_dependent: bool
    # (world, context, rng) -> (question, plan without the final response_gen step, answer)
    generate: Callable[[World, EpisodeContext, random.Random], tuple[str, list[list[ToolCall]], str]]
    # (question, observations: tool contents per plan step, per call) -> answer
    derive: Callable[[str, list[list[Any]]], str]


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments)


def _local_today(world: World, ctx: EpisodeContext, city: str) -> dt.date:
    return local_datetime(world.cities[city], ctx.now_utc).date()


def _now_weather(world, ctx, city):
    now = local_datetime(world.cities[city], ctx.now_utc)
    day = world.weather[(city, now.date())]
    return day.condition, current_temperature(day, now.hour + now.minute / 60)


def _pick_city(world, rng, exclude=()):
    return rng.choice([c for c in sorted(world.cities) if c not in exclude])


# ----------------------------------------------------------------- weather
def weather_now(world, ctx, rng):
    city = _pick_city(world, rng)
    cond, temp = _now_weather(world, ctx, city)
    return f"What's the weather like in {city} right now?", [[call("get_weather", city=city)]], f"{cond}, {temp}°C"


def weather_near_me(world, ctx, rng):
    cond, temp = _now_weather(world, ctx, ctx.user_city)
    phrasing = rng.choice(["What's the weather like where I am?", "How's the weather outside right now?",
                           "Is it cold near me at the moment? Tell me the current conditions."])
    return phrasing, [[call("current_location")], [call("get_weather", city=ctx.user_city)]], f"{cond}, {temp}°C"


def weather_two_cities(world, ctx, rng):
    a = _pick_city(world, rng)
    b = _pick_city(world, rng, (a,))
    (ca, ta), (cb, tb) = _now_weather(world, ctx, a), _now_weather(world, ctx, b)
    plan = [[call("get_weather", city=a), call("get_weather", city=b)]]
    return f"What's the weather right now in {a} and in {b}?", plan, f"{a}: {ca}, {ta}°C; {b}: {cb}, {tb}°C"


def temperature_difference(world, ctx, rng):
    a = _pick_city(world, rng)
    b = _pick_city(world, rng, (a,))
    ta, tb = _now_weather(world, ctx, a)[1], _now_weather(world, ctx, b)[1]
    plan = [[call("get_weather", city=a), call("get_weather", city=b)], [call("calculate", expression=f"{ta} - {tb}")]]
    return f"How many degrees Celsius warmer is it in {a} than in {b} right now?", plan, number(ta - tb)


def forecast_high_fahrenheit(world, ctx, rng):
    city = _pick_city(world, rng)
    day = _local_today(world, ctx, city) + dt.timedelta(days=rng.randint(1, 5))
    high = world.weather[(city, day)].high_c
    fahrenheit = round(high * 9 / 5 + 32, 2)
    plan = [[call("get_forecast", city=city, date=day.isoformat())],
            [call("convert_units", value=high, from_unit="c", to_unit="f")]]
    return f"What is the forecast high for {city} on {day.isoformat()}, in Fahrenheit?", plan, f"{number(fahrenheit)}°F"


def umbrella_tomorrow(world, ctx, rng):
    city = ctx.user_city
    today = _local_today(world, ctx, city)
    tomorrow = today + dt.timedelta(days=1)
    chance = world.weather[(city, tomorrow)].precipitation_chance_pct
    plan = [[call("current_location")], [call("local_time", city=city)],
            [call("date_add", date=today.isoformat(), days=1)],
            [call("get_forecast", city=city, date=tomorrow.isoformat())]]
    return ("Should I take an umbrella tomorrow? Answer yes if the chance of rain here is at least 50%.",
            plan, "yes" if chance >= 50 else "no")


# ----------------------------------------------------------------- sports
def _final_games(world):
    return [g for g in world.games if g.home_score is not None]


def game_score(world, ctx, rng):
    g = rng.choice(_final_games(world))
    plan = [[call("get_scores", league=world.leagues[g.league], date=g.date.isoformat())]]
    return (f"What was the final score of the {g.league} game between the {g.home} and the {g.away} on "
            f"{g.date.isoformat()}?", plan, f"{g.home} {g.home_score}-{g.away_score} {g.away}")


def team_points_on_date(world, ctx, rng):
    g = rng.choice(_final_games(world))
    team, score = (g.home, g.home_score) if rng.random() < 0.5 else (g.away, g.away_score)
    plan = [[call("lookup_fact", entity=team, attribute="league")],
            [call("get_scores", league=g.league, date=g.date.isoformat())]]
    return f"How many points did the {team} score on {g.date.isoformat()}?", plan, str(score)


def league_leader(world, ctx, rng):
    league = rng.choice(sorted(world.leagues))
    leader = standings(world, league)[0]["team"]
    return f"Which team is top of the {league} right now?", [[call("get_standings", league=league)]], leader


def points_gap(world, ctx, rng):
    league = rng.choice(sorted(world.leagues))
    table = standings(world, league)
    first, second = table[0]["points"], table[1]["points"]
    plan = [[call("get_standings", league=world.leagues[league])],
            [call("calculate", expression=f"{first} - {second}")]]
    return f"How many points separate first and second place in the {league} at the moment?", plan, str(first - second)


# ----------------------------------------------------------------- geo
def distance_miles(world, ctx, rng):
    a = _pick_city(world, rng)
    b = _pick_city(world, rng, (a,))
    miles = round(great_circle_km(world.cities[a], world.cities[b]) / 1.609344, 1)
    plan = [[call("distance_between", origin=a, destination=b, unit="mi")]]
    return f"How far is {a} from {b} in miles?", plan, f"{number(miles)} mi"


def distance_from_me(world, ctx, rng):
    b = _pick_city(world, rng, (ctx.user_city,))
    km = round(great_circle_km(world.cities[ctx.user_city], world.cities[b]), 1)
    plan = [[call("current_location")], [call("distance_between", origin=ctx.user_city, destination=b, unit="km")]]
    return f"How far away is {b} from here, in kilometres?", plan, f"{number(km)} km"


def city_country(world, ctx, rng):
    city = _pick_city(world, rng)
    return f"Which country is {city} in?", [[call("geocode", city=city)]], world.cities[city].country


# ----------------------------------------------------------------- knowledge
def city_population(world, ctx, rng):
    city = _pick_city(world, rng)
    plan = [[call("lookup_fact", entity=city, attribute="population")]]
    return f"What is the population of {city}?", plan, str(world.cities[city].population)


def company_ceo(world, ctx, rng):
    company = world.companies[rng.choice(sorted(world.companies))]
    plan = [[call("lookup_fact", entity=company.name, attribute="ceo")]]
    return f"Who is the CEO of {company.name}?", plan, company.ceo


def headquarters_weather(world, ctx, rng):
    company = world.companies[rng.choice(sorted(world.companies))]
    cond, temp = _now_weather(world, ctx, company.headquarters)
    plan = [[call("lookup_fact", entity=company.name, attribute="headquarters")],
            [call("get_weather", city=company.headquarters)]]
    return f"What's the weather like right now where {company.name} has its headquarters?", plan, f"{cond}, {temp}°C"


# ----------------------------------------------------------------- clock
def time_in_city(world, ctx, rng):
    city = _pick_city(world, rng)
    now = local_datetime(world.cities[city], ctx.now_utc)
    return f"What time is it in {city} right now?", [[call("local_time", city=city)]], now.strftime("%H:%M")


def convert_meeting_time(world, ctx, rng):
    a = _pick_city(world, rng)
    b = _pick_city(world, rng, (a,))
    moment = dt.datetime.combine(world.today + dt.timedelta(days=rng.randint(-5, 5)),
                                 dt.time(rng.randint(0, 23), rng.choice([0, 30])))
    converted = moment + dt.timedelta(hours=world.cities[b].utc_offset - world.cities[a].utc_offset)
    stamp = moment.strftime("%Y-%m-%dT%H:%M")
    plan = [[call("convert_timezone", datetime=stamp, from_city=a, to_city=b)]]
    return (f"A call is set for {moment.strftime('%H:%M')} on {moment.date().isoformat()} in {a}. "
            f"What date and time is that in {b}?", plan, converted.strftime("%Y-%m-%d %H:%M"))


def days_until(world, ctx, rng):
    today = _local_today(world, ctx, ctx.user_city)
    target = today + dt.timedelta(days=rng.randint(2, 200))
    plan = [[call("current_location")], [call("local_time", city=ctx.user_city)],
            [call("date_diff", start_date=today.isoformat(), end_date=target.isoformat())]]
    return f"How many days from today until {target.isoformat()}?", plan, str((target - today).days)


def weekday_after(world, ctx, rng):
    start = world.today + dt.timedelta(days=rng.randint(-400, 400))
    days = rng.randint(1, 120)
    plan = [[call("date_add", date=start.isoformat(), days=days)]]
    result = start + dt.timedelta(days=days)
    return f"Which day of the week is {days} days after {start.isoformat()}?", plan, result.strftime("%A")


# ----------------------------------------------------------------- news
def latest_headline(world, ctx, rng):
    topic = rng.choice(NEWS_TOPICS)
    newest = max(a.date for a in world.articles if a.topic == topic)
    article = next(a for a in world.articles if a.topic == topic and a.date == newest)
    plan = [[call("search_news", topic=topic, limit=1)]]
    return f"What's the latest {topic} headline?", plan, article.headline


def headline_on_date(world, ctx, rng):
    article = rng.choice(world.articles)
    plan = [[call("search_news", topic=article.topic, date=article.date.isoformat(), limit=1)]]
    first = next(a for a in world.articles if a.topic == article.topic and a.date == article.date)
    return f"What was the top {article.topic} headline on {article.date.isoformat()}?", plan, first.headline


# ----------------------------------------------------------------- flights
def _route_flights(world, rng):
    flight = world.flights[rng.choice(sorted(world.flights))]
    same = sorted((f for f in world.flights.values()
                   if f.origin == flight.origin and f.destination == flight.destination),
                  key=lambda f: (f.departure, f.number))
    return flight, same


def cheapest_flight(world, ctx, rng):
    flight, same = _route_flights(world, rng)
    day = world.today + dt.timedelta(days=rng.randint(0, 7))
    rows = [flight_summary(world, f, day) for f in same]
    best = sorted(rows, key=lambda r: r["price_usd"])[0]
    plan = [[call("search_flights", origin=flight.origin, destination=flight.destination, date=day.isoformat())],
            [call("sort_list", items=rows, field="price_usd", limit=1)]]
    return (f"Which is the cheapest direct flight from {flight.origin} to {flight.destination} on "
            f"{day.isoformat()}?", plan, best["flight_number"])


def morning_flights(world, ctx, rng):
    flight, same = _route_flights(world, rng)
    day = world.today + dt.timedelta(days=rng.randint(0, 7))
    rows = [flight_summary(world, f, day) for f in same]
    plan = [[call("search_flights", origin=flight.origin, destination=flight.destination, date=day.isoformat())],
            [call("filter_list", items=rows, field="departure", operator="<", value="12:00")]]
    count = sum(1 for f in same if f.departure < "12:00")
    return (f"How many direct flights from {flight.origin} to {flight.destination} leave before noon on "
            f"{day.isoformat()}?", plan, str(count))


def flight_today(world, ctx, rng):
    flight = world.flights[rng.choice(sorted(world.flights))]
    today = _local_today(world, ctx, flight.origin)
    status = world.flight_days[(flight.number, today)].status
    plan = [[call("local_time", city=flight.origin)],
            [call("flight_status", flight_number=flight.number, date=today.isoformat())]]
    return f"Is today's flight {flight.number} from {flight.origin} on time?", plan, status


# ----------------------------------------------------------------- stocks
def _company(world, rng):
    return world.companies[rng.choice(sorted(world.companies))]


def company_stock_price(world, ctx, rng):
    company = _company(world, rng)
    price = world.prices[(company.ticker, trading_days(world, company.ticker)[-1])]
    plan = [[call("lookup_fact", entity=company.name, attribute="ticker")], [call("stock_quote", ticker=company.ticker)]]
    return f"What's {company.name}'s share price right now?", plan, f"{number(price)} USD"


def compare_stocks(world, ctx, rng):
    a = _company(world, rng)
    b = rng.choice([c for c in world.companies.values() if c.ticker != a.ticker])
    pa, pb = (world.prices[(c.ticker, trading_days(world, c.ticker)[-1])] for c in (a, b))
    if pa == pb:
        raise Skip("equal prices")
    plan = [[call("stock_quote", ticker=a.ticker), call("stock_quote", ticker=b.ticker)]]
    return (f"Which stock is trading higher right now, {a.ticker} or {b.ticker}?", plan,
            a.ticker if pa > pb else b.ticker)


def closing_price(world, ctx, rng):
    company = _company(world, rng)
    day = rng.choice(trading_days(world, company.ticker)[:-1])
    plan = [[call("stock_history", ticker=company.ticker, start_date=day.isoformat(), end_date=day.isoformat())]]
    return (f"What was {company.ticker}'s closing price on {day.isoformat()}?", plan,
            f"{number(world.prices[(company.ticker, day)])} USD")


def shares_in_currency(world, ctx, rng):
    company = _company(world, rng)
    shares = rng.randint(2, 50)
    currency = rng.choice([c for c in sorted(world.exchange_rates) if c != "USD"])
    price = world.prices[(company.ticker, trading_days(world, company.ticker)[-1])]
    from steprl_jax.tools.calculator import calculate
    total = calculate(f"{price} * {shares}")
    converted = round(float(total) * world.exchange_rates[currency], 2)
    plan = [[call("stock_quote", ticker=company.ticker)], [call("calculate", expression=f"{price} * {shares}")],
            [call("convert_currency", amount=float(total), from_currency="USD", to_currency=currency)]]
    return (f"How much are {shares} shares of {company.ticker} worth in {currency} at the current price?", plan,
            f"{number(converted)} {currency}")


# ----------------------------------------------------------------- derive: answers from tool outputs
def _weather_text(w: dict) -> str:
    return f"{w['condition']}, {w['temperature_c']}°C"


def _game_in_question(question: str, games: list[dict]) -> dict:
    return next(g for g in games if f"the {g['home']} and" in question and f"the {g['away']} on" in question)


def _team_score(question: str, games: list[dict]) -> str:
    for g in games:
        for side in ("home", "away"):
            if f"did the {g[side]} score" in question:
                return str(g[f"{side}_score"])
    raise LookupError("team not found in scores")


def _quote_price(quote: dict) -> str:
    return f"{number(quote['price'])} USD"


T = Template
TEMPLATES: dict[str, Template] = {t.name: t for t in [
    T("weather_now", ("weather",), True, False, weather_now, lambda q, o: _weather_text(o[0][0])),
    T("weather_near_me", ("weather",), True, True, weather_near_me, lambda q, o: _weather_text(o[1][0])),
    T("weather_two_cities", ("weather",), True, False, weather_two_cities,
      lambda q, o: "; ".join(f"{w['city']}: {_weather_text(w)}" for w in o[0])),
    T("temperature_difference", ("weather",), True, False, temperature_difference, lambda q, o: o[1][0]["result"]),
    T("forecast_high_fahrenheit", ("weather",), False, False, forecast_high_fahrenheit,
      lambda q, o: f"{number(o[1][0]['value'])}°F"),
    T("umbrella_tomorrow", ("weather", "clock"), True, True, umbrella_tomorrow,
      lambda q, o: "yes" if o[3][0]["precipitation_chance_pct"] >= 50 else "no"),
    T("game_score", ("sports",), False, False, game_score,
      lambda q, o: (lambda g: f"{g['home']} {g['home_score']}-{g['away_score']} {g['away']}")(
          _game_in_question(q, o[0][0]["games"]))),
    T("team_points_on_date", ("sports", "knowledge"), False, False, team_points_on_date,
      lambda q, o: _team_score(q, o[1][0]["games"])),
    T("league_leader", ("sports",), True, False, league_leader, lambda q, o: o[0][0]["standings"][0]["team"]),
    T("points_gap", ("sports",), True, False, points_gap, lambda q, o: o[1][0]["result"]),
    T("distance_miles", ("geo",), False, False, distance_miles, lambda q, o: f"{number(o[0][0]['distance'])} mi"),
    T("distance_from_me", ("geo",), False, True, distance_from_me, lambda q, o: f"{number(o[1][0]['distance'])} km"),
    T("city_country", ("geo",), False, False, city_country, lambda q, o: o[0][0]["country"]),
    T("city_population", ("knowledge",), False, False, city_population, lambda q, o: str(o[0][0]["value"])),
    T("company_ceo", ("knowledge",), False, False, company_ceo, lambda q, o: o[0][0]["value"]),
    T("headquarters_weather", ("knowledge", "weather"), True, False, headquarters_weather,
      lambda q, o: _weather_text(o[1][0])),
    T("time_in_city", ("clock",), True, False, time_in_city, lambda q, o: o[0][0]["time"]),
    T("convert_meeting_time", ("clock",), False, False, convert_meeting_time,
      lambda q, o: o[0][0]["datetime"].replace("T", " ")),
    T("days_until", ("clock",), True, True, days_until, lambda q, o: str(o[2][0]["days"])),
    T("weekday_after", ("clock",), False, False, weekday_after, lambda q, o: o[0][0]["weekday"]),
    T("latest_headline", ("news",), True, False, latest_headline, lambda q, o: o[0][0]["articles"][0]["headline"]),
    T("headline_on_date", ("news",), False, False, headline_on_date, lambda q, o: o[0][0]["articles"][0]["headline"]),
    T("cheapest_flight", ("flights",), False, False, cheapest_flight,
      lambda q, o: o[1][0]["items"][0]["flight_number"]),
    T("morning_flights", ("flights",), False, False, morning_flights, lambda q, o: str(o[1][0]["count"])),
    T("flight_today", ("flights", "clock"), True, False, flight_today, lambda q, o: o[1][0]["status"]),
    T("company_stock_price", ("stocks", "knowledge"), True, False, company_stock_price,
      lambda q, o: _quote_price(o[1][0])),
    T("compare_stocks", ("stocks",), True, False, compare_stocks,
      lambda q, o: max(o[0], key=lambda quote: quote["price"])["ticker"]),
    T("closing_price", ("stocks",), False, False, closing_price,
      lambda q, o: f"{number(o[0][0]['prices'][0]['close'])} USD"),
    T("shares_in_currency", ("stocks",), True, False, shares_in_currency,
      lambda q, o: f"{number(o[2][0]['amount'])} {o[2][0]['currency']}"),
]}
# Kept out of training to test generalisation to unseen compositions.
HELD_OUT_TEMPLATES = frozenset({"umbrella_tomorrow", "headquarters_weather", "morning_flights", "shares_in_currency"})


def make_query(world: World, template: Template, rng: random.Random, index: int, split: str) -> Query:
    """One query from `template`, in a fresh random context (retries when the template does not fit)."""
    for _ in range(20):
        context = random_context(world, rng)
        try:
            question, steps, answer = template.generate(world, context, rng)
        except Skip:
            continue
        plan = tuple(tuple(step) for step in steps) + ((ToolCall(TERMINAL_TOOL, {"answer": answer}),),)
        return Query(f"{split}-{world.seed}-{index:06d}", template.name, template.domains, question, context, plan,
                     answer, template.time_dependent, template.location_dependent,
                     template.name in HELD_OUT_TEMPLATES, world.seed)
    raise RuntimeError(f"template {template.name} did not fit world {world.seed} in 20 tries")


def generate_queries(world: World, count: int, seed: int, split: str = "train",
                     templates: list[str] | None = None, exclude_questions: frozenset[str] = frozenset()) -> list[Query]:
    """`count` distinct queries, templates drawn in turn so that every domain is covered."""
    names = templates if templates is not None else sorted(TEMPLATES)
    rng = random.Random(f"{seed}/{split}")
    queries: list[Query] = []
    seen = set(exclude_questions)
    attempts = 0
    while len(queries) < count:
        attempts += 1
        if attempts > 50 * count + 100:
            raise RuntimeError(f"could only make {len(queries)} distinct queries of {count}")
        template = TEMPLATES[names[attempts % len(names)]]
        query = make_query(world, template, rng, len(queries), split)
        key = (query.question, query.context.user_city, query.context.now_utc)
        if key in seen or query.question in exclude_questions:
            continue
        seen.add(key)
        # another seed's queries get other ids: results of two query sets never pair by id
        queries.append(dataclasses.replace(query, id=f"{query.id}-s{seed}") if seed else query)
    return queries


def make_splits(world_seed: int, n_train: int, n_test: int, seed: int = 0) -> dict[str, list[Query]]:
    """Seeded splits. `train` excludes held-out templates; `test` uses them all and no train question;
    `test_held_out` is the test queries of held-out templates."""
    world = generate_world(world_seed)
    seen_names = sorted(set(TEMPLATES) - HELD_OUT_TEMPLATES)
    train = generate_queries(world, n_train, seed, "train", seen_names)
    test = generate_queries(world, n_test, seed, "test", None, frozenset(q.question for q in train))
    return {"train": train, "test": test, "test_held_out": [q for q in test if q.held_out]}


def derive_answer(query: Query, observations: list[list[Any]]) -> str:
    """The answer recomputed from the contents the plan's tool calls returned."""
    return TEMPLATES[query.template].derive(query.question, observations)


def query_statistics(queries: list[Query]) -> dict:
    n = max(1, len(queries))
    by_domain: dict[str, int] = {}
    by_steps: dict[int, int] = {}
    for q in queries:
        for d in q.domains:
            by_domain[d] = by_domain.get(d, 0) + 1
        by_steps[q.tool_steps] = by_steps.get(q.tool_steps, 0) + 1
    return {
        "queries": len(queries), "templates": len({q.template for q in queries}),
        "domains": dict(sorted(by_domain.items())), "tool_steps": dict(sorted(by_steps.items())),
        "mean_tool_calls": sum(q.tool_calls for q in queries) / n,
        "parallel_share": sum(any(len(s) > 1 for s in q.plan) for q in queries) / n,
        "time_dependent_share": sum(q.time_dependent for q in queries) / n,
        "location_dependent_share": sum(q.location_dependent for q in queries) / n,
        "held_out_share": sum(q.held_out for q in queries) / n,
    }
