"""The assistant's tools over a generated `World`, bound to one episode's context.

`make_tools(world, context)` returns the 22 tools plus the terminal `response_gen`;
`make_registry(...)` puts them in a `ToolRegistry`. Data-service tools can be made to fail
at a configured rate; failures are a pure function of (world seed, episode salt, call), so
replays and branches of a rollout tree see the same world.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import time
from typing import Any, Callable

from steprl_jax.tools.calculator import calculate as calculate_expression
from steprl_jax.tools.protocol import INVALID_VALUE, NOT_FOUND, TOOL_FAILURE, Tool, ToolError, object_schema
from steprl_jax.tools.registry import ToolRegistry
from steprl_jax.tools.world.generate import (
    FORECAST_DAYS, NEWS_TOPICS, City, EpisodeContext, World, current_temperature, great_circle_km,
    local_datetime)

TERMINAL_TOOL = "response_gen"
_DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "description": "a date, YYYY-MM-DD"}
_CITY = {"type": "string", "minLength": 1, "maxLength": 100, "description": "a city name, e.g. 'Paris'"}
_ITEMS = {"type": "array", "maxItems": 1000, "description": "a list of values or of objects"}
# (unit, dimension, value in the dimension's base unit); temperatures are handled apart.
_UNITS = {"m": ("length", 1.0), "km": ("length", 1000.0), "mi": ("length", 1609.344), "ft": ("length", 0.3048),
          "in": ("length", 0.0254), "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237),
          "oz": ("mass", 0.028349523125), "l": ("volume", 1.0), "ml": ("volume", 0.001),
          "gal": ("volume", 3.785411784), "kph": ("speed", 1.0), "mph": ("speed", 1.609344),
          "c": ("temperature", None), "f": ("temperature", None), "k": ("temperature", None)}
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
# Tools that stand for remote services and so can fail; utilities (dates, maths, lists) never do.
SERVICE_TOOLS = frozenset({"current_location", "get_weather", "get_forecast", "geocode", "distance_between",
                           "get_scores", "get_standings", "search_news", "search_flights", "flight_status",
                           "stock_quote", "stock_history", "lookup_fact", "convert_currency"})


def parse_date(value: str, field: str = "date") -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise ToolError(INVALID_VALUE, f"'{field}': {value!r} is not a valid date (use YYYY-MM-DD)") from None


def finite(value: float, what: str) -> float:
    """`value` as a float, or `invalid_value` when it is NaN, infinite or beyond a float's range."""
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise ToolError(INVALID_VALUE, f"{what} is not a finite number (limit about 1.8e308)")
    return number


def weekday(day: dt.date) -> str:
    return _WEEKDAYS[day.weekday()]


def round2(x: float) -> float:
    return round(float(x), 2)


class _Bound:
    """The tool functions, closed over one world and one episode context."""

    def __init__(self, world: World, context: EpisodeContext):
        self.world = world
        self.context = context
        if context.user_city not in world.cities:
            raise ValueError(f"episode context names unknown city {context.user_city!r}")

    # --- look-ups shared by several tools ---
    def city(self, name: str, field: str = "city") -> City:
        for city in self.world.cities.values():
            if city.name.casefold() == name.strip().casefold():
                return city
        raise ToolError(NOT_FOUND, f"'{field}': unknown city {name[:60]!r}; known cities: "
                        + ", ".join(sorted(self.world.cities)))

    def local_today(self, city: City) -> dt.date:
        return local_datetime(city, self.context.now_utc).date()

    def league(self, name: str) -> str:
        for full, short in self.world.leagues.items():
            if name.strip().casefold() in (full.casefold(), short.casefold()):
                return full
        raise ToolError(NOT_FOUND, f"unknown league {name[:60]!r}; leagues: "
                        + ", ".join(f"{f} ({s})" for f, s in self.world.leagues.items()))

    def ticker(self, symbol: str):
        company = self.world.company_by_ticker(symbol.strip().upper())
        if company is None:
            raise ToolError(NOT_FOUND, f"unknown ticker {symbol[:20]!r}; use lookup_fact(entity=<company>, "
                            "attribute='ticker') to find one")
        return company

    def in_data(self, day: dt.date, field: str) -> dt.date:
        if not self.world.first_day <= day <= self.world.last_day:
            raise ToolError(NOT_FOUND, f"'{field}': no data for {day.isoformat()}; records cover "
                            f"{self.world.first_day.isoformat()} to {self.world.last_day.isoformat()}")
        return day

    # --- geo and clock ---
    def current_location(self) -> dict:
        city = self.world.cities[self.context.user_city]
        return {"city": city.name, "country": city.country, "latitude": city.latitude, "longitude": city.longitude}

    def local_time(self, city: str) -> dict:
        c = self.city(city)
        now = local_datetime(c, self.context.now_utc)
        return {"city": c.name, "date": now.date().isoformat(), "time": now.strftime("%H:%M"),
                "weekday": weekday(now.date()), "utc_offset": c.timezone}

    def geocode(self, city: str) -> dict:
        c = self.city(city)
        return {"city": c.name, "country": c.country, "latitude": c.latitude, "longitude": c.longitude,
                "timezone": c.timezone}

    def distance_between(self, origin: str, destination: str, unit: str = "km") -> dict:
        km = great_circle_km(self.city(origin, "origin"), self.city(destination, "destination"))
        return {"distance": round(km / (1.609344 if unit == "mi" else 1.0), 1), "unit": unit}

    def convert_timezone(self, datetime: str, from_city: str, to_city: str) -> dict:
        try:
            moment = dt.datetime.strptime(datetime, "%Y-%m-%dT%H:%M")
        except ValueError:
            raise ToolError(INVALID_VALUE, f"'datetime': {datetime[:40]!r} is not YYYY-MM-DDTHH:MM") from None
        source, target = self.city(from_city, "from_city"), self.city(to_city, "to_city")
        try:
            converted = moment + dt.timedelta(hours=target.utc_offset - source.utc_offset)
        except OverflowError:
            raise ToolError(INVALID_VALUE, "'datetime': the converted date-time is out of range") from None
        return {"city": target.name, "datetime": converted.isoformat(timespec="minutes"),  # year 1 is 0001
                "weekday": weekday(converted.date())}

    def date_add(self, date: str, days: int) -> dict:
        try:
            result = parse_date(date) + dt.timedelta(days=days)
        except OverflowError:
            raise ToolError(INVALID_VALUE, "resulting date out of range") from None
        return {"date": result.isoformat(), "weekday": weekday(result)}

    def date_diff(self, start_date: str, end_date: str) -> dict:
        return {"days": (parse_date(end_date, "end_date") - parse_date(start_date, "start_date")).days}

    # --- weather ---
    def get_weather(self, city: str) -> dict:
        c = self.city(city)
        now = local_datetime(c, self.context.now_utc)
        day = self.world.weather[(c.name, now.date())]
        return {"city": c.name, "date": now.date().isoformat(), "time": now.strftime("%H:%M"),
                "condition": day.condition, "temperature_c": current_temperature(day, now.hour + now.minute / 60),
                "humidity_pct": day.humidity_pct, "wind_kph": day.wind_kph}

    def get_forecast(self, city: str, date: str) -> dict:
        c = self.city(city)
        day, today = parse_date(date), self.local_today(c)
        last = today + dt.timedelta(days=FORECAST_DAYS - 1)
        if not today <= day <= last:
            raise ToolError(INVALID_VALUE, f"'date': the forecast for {c.name} covers {today.isoformat()} to "
                            f"{last.isoformat()} (local dates); {day.isoformat()} is outside it")
        w = self.world.weather[(c.name, day)]
        return {"city": c.name, "date": day.isoformat(), "condition": w.condition, "high_c": w.high_c,
                "low_c": w.low_c, "precipitation_chance_pct": w.precipitation_chance_pct}

    # --- sports ---
    def get_scores(self, league: str, date: str) -> dict:
        name, day = self.league(league), self.in_data(parse_date(date), "date")
        games = [{"home": g.home, "away": g.away, "home_score": g.home_score, "away_score": g.away_score,
                  "status": "final" if g.home_score is not None else "scheduled"}
                 for g in self.world.games if g.league == name and g.date == day]
        return {"league": name, "date": day.isoformat(), "games": games}

    def get_standings(self, league: str) -> dict:
        name = self.league(league)
        return {"league": name, "standings": standings(self.world, name)}

    # --- news ---
    def search_news(self, topic: str, date: str | None = None, limit: int = 3) -> dict:
        topic = topic.strip().lower()
        if topic not in NEWS_TOPICS:
            raise ToolError(INVALID_VALUE, f"'topic': unknown topic {topic[:40]!r}; topics: {', '.join(NEWS_TOPICS)}")
        today = self.world.today
        if date is not None:
            day = parse_date(date)
            if day > today:
                raise ToolError(INVALID_VALUE, f"'date': {day.isoformat()} is in the future")
            found = [a for a in self.world.articles if a.topic == topic and a.date == day]
        else:
            found = sorted((a for a in self.world.articles if a.topic == topic), key=lambda a: a.date, reverse=True)
        if not found:
            raise ToolError(NOT_FOUND, f"no {topic} articles for {date or 'this period'}")
        return {"topic": topic, "articles": [{"headline": a.headline, "date": a.date.isoformat(),
                                              "source": a.source} for a in found[:int(limit)]]}  # 2.0 is an integer

    # --- flights ---
    def search_flights(self, origin: str, destination: str, date: str) -> dict:
        a, b = self.city(origin, "origin"), self.city(destination, "destination")
        day = self.in_data(parse_date(date), "date")
        found = sorted((f for f in self.world.flights.values() if f.origin == a.name and f.destination == b.name),
                       key=lambda f: (f.departure, f.number))
        if not found:
            raise ToolError(NOT_FOUND, f"no direct flights from {a.name} to {b.name}")
        return {"origin": a.name, "destination": b.name, "date": day.isoformat(),
                "flights": [flight_summary(self.world, f, day) for f in found]}

    def flight_status(self, flight_number: str, date: str) -> dict:
        flight = self.world.flights.get(flight_number.strip().upper())
        if flight is None:
            raise ToolError(NOT_FOUND, f"unknown flight number {flight_number[:20]!r}")
        day = self.in_data(parse_date(date), "date")
        info = self.world.flight_days[(flight.number, day)]
        scheduled = dt.datetime.combine(day, dt.time.fromisoformat(flight.departure))
        expected = scheduled + dt.timedelta(minutes=info.delay_min)
        return {"flight_number": flight.number, "date": day.isoformat(), "origin": flight.origin,
                "destination": flight.destination, "status": info.status, "scheduled_departure": flight.departure,
                "expected_departure": None if info.status == "cancelled" else expected.strftime("%H:%M"),
                "delay_minutes": info.delay_min, "gate": info.gate}

    # --- stocks and money ---
    def stock_quote(self, ticker: str) -> dict:
        company = self.ticker(ticker)
        days = trading_days(self.world, company.ticker)
        last, previous = days[-1], days[-2]
        price, before = self.world.prices[(company.ticker, last)], self.world.prices[(company.ticker, previous)]
        return {"ticker": company.ticker, "company": company.name, "price": price, "currency": "USD",
                "change_pct": round2(100 * (price - before) / before), "as_of": last.isoformat()}

    def stock_history(self, ticker: str, start_date: str, end_date: str) -> dict:
        company = self.ticker(ticker)
        start, end = parse_date(start_date, "start_date"), parse_date(end_date, "end_date")
        if start > end:
            raise ToolError(INVALID_VALUE, "'start_date' is after 'end_date'")
        if end > self.world.today:
            raise ToolError(INVALID_VALUE, f"'end_date': {end.isoformat()} is in the future")
        rows = [{"date": d.isoformat(), "close": self.world.prices[(company.ticker, d)]}
                for d in trading_days(self.world, company.ticker) if start <= d <= end]
        if not rows:
            raise ToolError(NOT_FOUND, f"no trading days for {company.ticker} between {start} and {end} "
                            "(markets close at weekends; history starts "
                            f"{self.world.first_day.isoformat()})")
        return {"ticker": company.ticker, "prices": rows}

    def convert_currency(self, amount: float, from_currency: str, to_currency: str) -> dict:
        rates = self.world.exchange_rates
        amount = finite(amount, "'amount'")
        for field, code in (("from_currency", from_currency), ("to_currency", to_currency)):
            if code.upper() not in rates:
                raise ToolError(NOT_FOUND, f"'{field}': unknown currency {code[:10]!r}; known: {', '.join(rates)}")
        value = amount / rates[from_currency.upper()] * rates[to_currency.upper()]
        return {"amount": round2(finite(value, "the converted amount")), "currency": to_currency.upper()}

    # --- knowledge ---
    def lookup_fact(self, entity: str, attribute: str) -> dict:
        facts = entity_facts(self.world)
        key = next((k for k in facts if k.casefold() == entity.strip().casefold()), None)
        if key is None:
            raise ToolError(NOT_FOUND, f"no entity named {entity[:60]!r} in the knowledge base")
        attribute = attribute.strip().lower()
        if attribute not in facts[key]:
            raise ToolError(INVALID_VALUE, f"'attribute': {key} has no {attribute[:40]!r}; available: "
                            + ", ".join(facts[key]))
        return {"entity": key, "attribute": attribute, "value": facts[key][attribute]}

    # --- pure utilities ---
    def convert_units(self, value: float, from_unit: str, to_unit: str) -> dict:
        (dim_a, scale_a), (dim_b, scale_b) = _UNITS[from_unit], _UNITS[to_unit]
        if dim_a != dim_b:
            raise ToolError(INVALID_VALUE, f"cannot convert {dim_a} ({from_unit}) to {dim_b} ({to_unit})")
        value = finite(value, "'value'")
        if dim_a == "temperature":
            kelvin = {"c": value + 273.15, "f": (value - 32) * 5 / 9 + 273.15, "k": value}[from_unit]
            result = {"c": kelvin - 273.15, "f": (kelvin - 273.15) * 9 / 5 + 32, "k": kelvin}[to_unit]
        else:
            result = value * scale_a / scale_b
        return {"value": round2(finite(result, "the converted value")), "unit": to_unit}

    def calculate(self, expression: str) -> dict:
        return {"result": calculate_expression(expression)}

    def filter_list(self, items: list, operator: str, value: Any, field: str | None = None) -> dict:
        def keep(item: Any) -> bool:
            if field is not None:
                if not isinstance(item, dict) or field not in item:
                    raise ToolError(INVALID_VALUE, f"'field': an item has no field {field[:40]!r}")
                item = item[field]
            return compare(item, operator, value)

        kept = [item for item in items if keep(item)]
        return {"items": kept, "count": len(kept)}

    def sort_list(self, items: list, field: str | None = None, descending: bool = False,
                  limit: int | None = None) -> dict:
        def key(item: Any):
            if field is not None:
                if not isinstance(item, dict) or field not in item:
                    raise ToolError(INVALID_VALUE, f"'field': an item has no field {field[:40]!r}")
                item = item[field]
            if not isinstance(item, (int, float, str)) or isinstance(item, bool):
                raise ToolError(INVALID_VALUE, "sort keys must be numbers or strings")
            return (isinstance(item, str), item)  # numbers before strings, never compared with each other

        ordered = sorted(items, key=key, reverse=descending)
        return {"items": ordered[:int(limit)] if limit is not None else ordered}  # 2.0 is an integer

    def response_gen(self, answer: str) -> dict:
        return {"answer": answer}


def compare(item: Any, operator: str, value: Any) -> bool:
    if operator == "contains":
        return isinstance(item, str) and isinstance(value, str) and value.casefold() in item.casefold()
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (item, value))
    textual = isinstance(item, str) and isinstance(value, str)
    if operator in ("==", "!="):
        return (item == value) == (operator == "==")
    if not (numeric or textual):
        raise ToolError(INVALID_VALUE, f"cannot compare {type(item).__name__} with {type(value).__name__} "
                        f"using {operator!r}")
    return {"<": item < value, "<=": item <= value, ">": item > value, ">=": item >= value}[operator]


def trading_days(world: World, ticker: str) -> list[dt.date]:
    return sorted(d for (t, d) in world.prices if t == ticker)


def standings(world: World, league: str) -> list[dict]:
    """Table of final games: 3 points a win, 1 a draw; ties by wins, then name."""
    table = {t.name: {"team": t.name, "played": 0, "wins": 0, "draws": 0, "losses": 0, "points": 0}
             for t in world.teams.values() if t.league == league}
    for g in world.games:
        if g.league != league or g.home_score is None:
            continue
        for team, mine, theirs in ((g.home, g.home_score, g.away_score), (g.away, g.away_score, g.home_score)):
            row = table[team]
            row["played"] += 1
            outcome = "wins" if mine > theirs else ("draws" if mine == theirs else "losses")
            row[outcome] += 1
            row["points"] += {"wins": 3, "draws": 1, "losses": 0}[outcome]
    ordered = sorted(table.values(), key=lambda r: (-r["points"], -r["wins"], r["team"]))
    return [{"rank": i + 1, **row} for i, row in enumerate(ordered)]


def flight_summary(world: World, flight, day: dt.date) -> dict:
    info = world.flight_days[(flight.number, day)]
    departure = dt.datetime.combine(day, dt.time.fromisoformat(flight.departure))
    arrival_origin_clock = departure + dt.timedelta(minutes=flight.duration_min)
    shift = world.cities[flight.destination].utc_offset - world.cities[flight.origin].utc_offset
    arrival = arrival_origin_clock + dt.timedelta(hours=shift)
    return {"flight_number": flight.number, "airline": flight.airline, "departure": flight.departure,
            "arrival": arrival.strftime("%Y-%m-%dT%H:%M"), "duration_min": flight.duration_min,
            "price_usd": info.price_usd, "status": info.status}


def entity_facts(world: World) -> dict[str, dict[str, Any]]:
    facts: dict[str, dict[str, Any]] = {}
    for c in world.cities.values():
        facts[c.name] = {"type": "city", "country": c.country, "population": c.population,
                         "elevation_m": c.elevation_m, "timezone": c.timezone}
    for co in world.companies.values():
        facts[co.name] = {"type": "company", "ticker": co.ticker, "sector": co.sector,
                          "headquarters": co.headquarters, "founded": co.founded, "ceo": co.ceo,
                          "employees": co.employees}
    for t in world.teams.values():
        facts[t.name] = {"type": "sports team", "league": t.league, "home_city": t.city, "stadium": t.stadium,
                         "founded": t.founded}
    return facts


_LEAGUE_NAME = {"type": "string", "minLength": 1, "maxLength": 100,
                "description": "league name or abbreviation, e.g. 'CFL'"}
_SPECS: list[tuple[str, str, dict, list[str] | None]] = [
    ("current_location", "The user's current city and coordinates.", {}, None),
    ("local_time", "The current local date, time and weekday in a city.", {"city": _CITY}, None),
    ("geocode", "Country, coordinates and time zone of a city.", {"city": _CITY}, None),
    ("distance_between", "Great-circle distance between two cities.",
     {"origin": _CITY, "destination": _CITY, "unit": {"type": "string", "enum": ["km", "mi"]}},
     ["origin", "destination"]),
    ("convert_timezone", "Convert a local date-time in one city to the local date-time in another.",
     {"datetime": {"type": "string", "description": "local date-time YYYY-MM-DDTHH:MM"},
      "from_city": _CITY, "to_city": _CITY}, None),
    ("date_add", "Add a number of days (may be negative) to a date.",
     {"date": _DATE, "days": {"type": "integer", "minimum": -36600, "maximum": 36600}}, None),
    ("date_diff", "Number of days from start_date to end_date.", {"start_date": _DATE, "end_date": _DATE}, None),
    ("get_weather", "Current weather in a city (right now, local time).", {"city": _CITY}, None),
    ("get_forecast", f"Daily forecast for a city for one local date, today up to {FORECAST_DAYS - 1} days ahead.",
     {"city": _CITY, "date": _DATE}, None),
    ("get_scores", "Games and scores of a league on a date.", {"league": _LEAGUE_NAME, "date": _DATE}, None),
    ("get_standings", "Current league table (3 points a win, 1 a draw).", {"league": _LEAGUE_NAME}, None),
    ("search_news", "Latest news headlines on a topic, or those of one date.",
     {"topic": {"type": "string", "enum": NEWS_TOPICS}, "date": _DATE,
      "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, ["topic"]),
    ("search_flights", "Direct flights between two cities on a date, by departure time (local).",
     {"origin": _CITY, "destination": _CITY, "date": _DATE}, None),
    ("flight_status", "Status, delay and gate of a flight on a date.",
     {"flight_number": {"type": "string", "pattern": "^[A-Za-z]{2}[0-9]{1,4}$"}, "date": _DATE}, None),
    ("stock_quote", "Latest price of a stock (USD) and its change since the previous close.",
     {"ticker": {"type": "string", "minLength": 1, "maxLength": 10}}, None),
    ("stock_history", "Daily closing prices of a stock between two dates (trading days only).",
     {"ticker": {"type": "string", "minLength": 1, "maxLength": 10}, "start_date": _DATE, "end_date": _DATE},
     None),
    ("convert_currency", "Convert an amount of money between currencies at today's rate.",
     {"amount": {"type": "number"}, "from_currency": {"type": "string", "pattern": "^[A-Za-z]{3}$"},
      "to_currency": {"type": "string", "pattern": "^[A-Za-z]{3}$"}}, None),
    ("lookup_fact", "A fact about a city, company or sports team (e.g. population, ticker, ceo, stadium).",
     {"entity": {"type": "string", "minLength": 1, "maxLength": 100},
      "attribute": {"type": "string", "minLength": 1, "maxLength": 40}}, None),
    ("convert_units", "Convert a value between units of length, mass, volume, speed or temperature.",
     {"value": {"type": "number"}, "from_unit": {"type": "string", "enum": sorted(_UNITS)},
      "to_unit": {"type": "string", "enum": sorted(_UNITS)}}, None),
    ("calculate", "Evaluate an arithmetic expression exactly (+ - * / // % **, sqrt, abs, round, min, max).",
     {"expression": {"type": "string", "minLength": 1, "maxLength": 500}}, None),
    ("filter_list", "Keep the items (or items[field]) that satisfy `<operator> value`.",
     {"items": _ITEMS, "field": {"type": "string"},
      "operator": {"type": "string", "enum": ["==", "!=", "<", "<=", ">", ">=", "contains"]},
      "value": {"type": ["string", "number", "boolean", "null"]}}, ["items", "operator", "value"]),
    ("sort_list", "Sort items (by a field of each item if given), optionally keeping the first `limit`.",
     {"items": _ITEMS, "field": {"type": "string"}, "descending": {"type": "boolean"},
      "limit": {"type": "integer", "minimum": 1}}, ["items"]),
    (TERMINAL_TOOL, "Give the final answer to the user. Ends the episode.",
     {"answer": {"type": "string", "maxLength": 4000}}, None),
]
TOOL_NAMES = tuple(spec[0] for spec in _SPECS)  # the answer tool, response_gen, last


def _failure_draw(seed: int, salt: str, name: str, arguments: dict) -> float:
    key = json.dumps([seed, salt, name, arguments], sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64


def make_tools(world: World, context: EpisodeContext, failure_rate: float = 0.0, salt: str = "",
               latency_s: tuple[float, float] = (0.0, 0.0), names=None) -> list[Tool]:
    """The tools of one episode: all of them, or those in `names` (in the world's order).
    `failure_rate` in [0, 1] makes service tools return `tool_failure`; `latency_s` (lo, hi): each
    call takes a duration drawn from [lo, hi] (a function of the call, as the failures are), as a
    remote service would; the calls' timeout grows with it."""
    unknown = sorted(set(names or ()) - set(TOOL_NAMES))
    if unknown:
        raise ValueError(f"unknown tool-world tools {unknown} (the world's: {', '.join(TOOL_NAMES)})")
    if not 0.0 <= failure_rate <= 1.0:
        raise ValueError(f"failure_rate must be in [0, 1], got {failure_rate}")
    lo, hi = (float(x) for x in latency_s)
    if not 0.0 <= lo <= hi:
        raise ValueError(f"latency_s must be (lo, hi) with 0 <= lo <= hi, got {tuple(latency_s)}")
    bound = _Bound(world, context)
    tools = []
    for name, description, properties, required in _SPECS:
        if names and name not in names:
            continue
        fn: Callable = getattr(bound, name)
        if name in SERVICE_TOOLS and failure_rate > 0:
            fn = _failing(fn, name, world.seed, salt, failure_rate)
        if hi > 0:
            fn = _slow(fn, name, world.seed, salt, lo, hi)
        tools.append(Tool(name, description, object_schema(properties, required), fn, timeout_s=2.0 + hi))
    return tools


def _slow(fn: Callable, name: str, seed: int, salt: str, lo: float, hi: float) -> Callable:
    def call(**arguments):
        time.sleep(lo + (hi - lo) * _failure_draw(seed, salt + "#latency", name, arguments))
        return fn(**arguments)

    return call


def _failing(fn: Callable, name: str, seed: int, salt: str, rate: float) -> Callable:
    def call(**arguments):
        if _failure_draw(seed, salt, name, arguments) < rate:
            raise ToolError(TOOL_FAILURE, f"the {name} service is temporarily unavailable")
        return fn(**arguments)

    return call


def make_registry(world: World, context: EpisodeContext, failure_rate: float = 0.0, salt: str = "",
                  default_timeout_s: float = 5.0, latency_s: tuple[float, float] = (0.0, 0.0),
                  names=None) -> ToolRegistry:
    return ToolRegistry(make_tools(world, context, failure_rate, salt, latency_s, names),
                        default_timeout_s=default_timeout_s)
