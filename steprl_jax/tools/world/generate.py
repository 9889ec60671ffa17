"""A seeded simulation of a virtual assistant's back-end data (PORTool's environment).

`generate_world(seed)` builds, in memory and in a few milliseconds, everything the tools
read: cities, daily weather, sports leagues and games, flights, stocks, exchange rates,
news and entity facts. The same seed always gives the same world. Time is simulated:
`World.today` is the UTC date around which all data lives; an episode's "now" and the
user's city are in `EpisodeContext`.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import math
import random

# name, country, latitude, longitude, UTC offset in hours (standard time, no daylight saving in this world)
CITY_TABLE = [
    ("London", "United Kingdom", 51.51, -0.13, 0), ("Paris", "France", 48.86, 2.35, 1),
    ("Berlin", "Germany", 52.52, 13.40, 1), ("Madrid", "Spain", 40.42, -3.70, 1),
    ("Rome", "Italy", 41.90, 12.50, 1), ("Stockholm", "Sweden", 59.33, 18.07, 1),
    ("Athens", "Greece", 37.98, 23.73, 2), ("Cairo", "Egypt", 30.04, 31.24, 2),
    ("Nairobi", "Kenya", -1.29, 36.82, 3), ("Dubai", "United Arab Emirates", 25.20, 55.27, 4),
    ("Mumbai", "India", 19.08, 72.88, 5.5), ("Bangkok", "Thailand", 13.76, 100.50, 7),
    ("Singapore", "Singapore", 1.35, 103.82, 8), ("Beijing", "China", 39.90, 116.41, 8),
    ("Tokyo", "Japan", 35.68, 139.69, 9), ("Seoul", "South Korea", 37.57, 126.98, 9),
    ("Sydney", "Australia", -33.87, 151.21, 10), ("Auckland", "New Zealand", -36.85, 174.76, 12),
    ("Sao Paulo", "Brazil", -23.55, -46.63, -3), ("Buenos Aires", "Argentina", -34.60, -58.38, -3),
    ("New York", "United States", 40.71, -74.01, -5), ("Toronto", "Canada", 43.65, -79.38, -5),
    ("Chicago", "United States", 41.88, -87.63, -6), ("Mexico City", "Mexico", 19.43, -99.13, -6),
    ("Denver", "United States", 39.74, -104.99, -7), ("Los Angeles", "United States", 34.05, -118.24, -8),
]
CONDITIONS = ["sunny", "partly cloudy", "cloudy", "rain", "thunderstorms", "fog", "snow"]
_RAIN_CHANCE = {"sunny": (0, 10), "partly cloudy": (5, 25), "cloudy": (15, 45), "rain": (60, 95),
                "thunderstorms": (70, 100), "fog": (10, 30), "snow": (55, 90)}
NEWS_TOPICS = ["technology", "sports", "politics", "business", "science", "health", "entertainment", "travel"]
CURRENCIES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 150.0, "CNY": 7.2, "INR": 83.0, "BRL": 5.0,
              "CAD": 1.36, "AUD": 1.52, "CHF": 0.88}
AIRLINES = {"SK": "Skylark Air", "NV": "Nova Airways", "BL": "Bluefin Airlines", "OR": "Orbit Air"}
_MASCOTS = ["Falcons", "Wolves", "Comets", "Tigers", "Rangers", "Pilots", "Owls", "Sharks", "Giants", "Royals"]
_FIRST = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ivan", "Jonas", "Keiko", "Luis",
          "Maya", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
_LAST = ["Abbott", "Brandt", "Costa", "Diallo", "Eriksen", "Fischer", "Garcia", "Hoshino", "Ivanova", "Jensen",
         "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Patel", "Rossi", "Silva", "Tanaka", "Weber"]
_COMPANY_A = ["Nor", "Vel", "Quan", "Aster", "Lumi", "Helio", "Tera", "Cobal", "Stra", "Zeph", "Orin", "Kine"]
_COMPANY_B = ["lex", "tron", "via", "gen", "ora", "dyne", "nix", "sys", "bright", "wave"]
_SECTORS = ["Systems", "Energy", "Foods", "Motors", "Health", "Robotics", "Finance", "Media"]
_LEAGUES = [("Continental Football League", "CFL"), ("Metro Basketball Association", "MBA"),
            ("Pacific Hockey League", "PHL")]

DATA_DAYS_BEFORE = 30  # history kept before `today`
DATA_DAYS_AFTER = 10   # future data (forecasts, schedules) after `today`
FORECAST_DAYS = 7      # the forecast covers local today and the next 6 days


@dataclasses.dataclass(frozen=True)
class City:
    name: str
    country: str
    latitude: float
    longitude: float
    utc_offset: float
    population: int
    elevation_m: int

    @property
    def timezone(self) -> str:
        hours = int(abs(self.utc_offset))
        minutes = round((abs(self.utc_offset) - hours) * 60)
        return f"UTC{'+' if self.utc_offset >= 0 else '-'}{hours:02d}:{minutes:02d}"


@dataclasses.dataclass(frozen=True)
class DayWeather:
    condition: str
    high_c: int
    low_c: int
    precipitation_chance_pct: int
    humidity_pct: int
    wind_kph: int


@dataclasses.dataclass(frozen=True)
class Team:
    name: str
    league: str
    city: str
    stadium: str
    founded: int


@dataclasses.dataclass(frozen=True)
class Game:
    league: str
    date: dt.date
    home: str
    away: str
    home_score: int | None  # None: not played yet
    away_score: int | None


@dataclasses.dataclass(frozen=True)
class Flight:
    number: str
    airline: str
    origin: str
    destination: str
    departure: str  # local time at origin, "HH:MM"
    duration_min: int


@dataclasses.dataclass(frozen=True)
class FlightDay:
    status: str  # "on time" | "delayed" | "cancelled"
    delay_min: int
    gate: str
    price_usd: int


@dataclasses.dataclass(frozen=True)
class Company:
    name: str
    ticker: str
    sector: str
    headquarters: str
    founded: int
    ceo: str
    employees: int


@dataclasses.dataclass(frozen=True)
class Article:
    topic: str
    date: dt.date
    headline: str
    source: str


@dataclasses.dataclass(frozen=True)
class World:
    seed: int
    today: dt.date
    cities: dict[str, City]
    weather: dict[tuple[str, dt.date], DayWeather]
    leagues: dict[str, str]  # name -> abbreviation
    teams: dict[str, Team]
    games: list[Game]
    flights: dict[str, Flight]
    flight_days: dict[tuple[str, dt.date], FlightDay]
    companies: dict[str, Company]
    prices: dict[tuple[str, dt.date], float]  # ticker, trading day -> close
    exchange_rates: dict[str, float]  # units per USD
    articles: list[Article]

    @property
    def first_day(self) -> dt.date:
        return self.today - dt.timedelta(days=DATA_DAYS_BEFORE)

    @property
    def last_day(self) -> dt.date:
        return self.today + dt.timedelta(days=DATA_DAYS_AFTER)

    def days(self) -> list[dt.date]:
        return [self.first_day + dt.timedelta(days=i) for i in range((self.last_day - self.first_day).days + 1)]

    def company_by_ticker(self, ticker: str) -> Company | None:
        return next((c for c in self.companies.values() if c.ticker == ticker), None)


@dataclasses.dataclass(frozen=True)
class EpisodeContext:
    """Where the user is and when "now" is (UTC), for one episode."""

    user_city: str
    now_utc: dt.datetime

    def to_json(self) -> dict:
        return {"user_city": self.user_city, "now_utc": self.now_utc.isoformat(timespec="minutes")}

    @classmethod
    def from_json(cls, record: dict) -> "EpisodeContext":
        return cls(record["user_city"], dt.datetime.fromisoformat(record["now_utc"]))


def local_datetime(city: City, moment_utc: dt.datetime) -> dt.datetime:
    return moment_utc + dt.timedelta(hours=city.utc_offset)


def great_circle_km(a: City, b: City) -> float:
    lat1, lon1, lat2, lon2 = map(math.radians, (a.latitude, a.longitude, b.latitude, b.longitude))
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * 6371.0 * math.asin(math.sqrt(h))


def current_temperature(day: DayWeather, local_hour: float) -> int:
    """Coldest near 05:00, warmest near 15:00."""
    shape = (1 - math.cos(2 * math.pi * ((local_hour - 5) % 24) / 20)) / 2 if (local_hour - 5) % 24 < 20 else 0.0
    return round(day.low_c + (day.high_c - day.low_c) * shape)


def _weather(rng: random.Random, city: City, days: list[dt.date]) -> dict:
    out = {}
    for day in days:
        season = math.cos(2 * math.pi * (day.timetuple().tm_yday - 15) / 365) * (1 if city.latitude >= 0 else -1)
        mean = 27 - 0.45 * abs(city.latitude) + 9 * season * min(1.0, abs(city.latitude) / 30) + rng.gauss(0, 3)
        spread = rng.randint(5, 12)
        high, low = round(mean + spread / 2), round(mean - spread / 2)
        choices = [c for c in CONDITIONS if c != "snow" or high <= 2]
        condition = rng.choice(choices)
        lo, hi = _RAIN_CHANCE[condition]
        out[(city.name, day)] = DayWeather(condition, high, low, rng.randint(lo, hi), rng.randint(30, 95),
                                           rng.randint(0, 45))
    return out


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def generate_world(seed: int) -> World:
    rng = random.Random(seed)
    today = dt.date(2025, 1, 1) + dt.timedelta(days=rng.randint(0, 364))
    cities = {name: City(name, country, lat, lon, off, rng.randint(300, 15_000) * 1000, rng.randint(0, 1600))
              for name, country, lat, lon, off in CITY_TABLE}
    world_days = [today - dt.timedelta(days=DATA_DAYS_BEFORE) + dt.timedelta(days=i)
                  for i in range(DATA_DAYS_BEFORE + DATA_DAYS_AFTER + 1)]
    weather: dict = {}
    for city in cities.values():
        weather.update(_weather(rng, city, world_days))

    # Sports: three leagues of six teams in distinct cities; every team plays about every other day.
    teams: dict[str, Team] = {}
    games: list[Game] = []
    leagues = dict(_LEAGUES)
    for league, _ in _LEAGUES:
        names = []
        for city_name, mascot in zip(rng.sample(sorted(cities), 6), rng.sample(_MASCOTS, 6)):
            while f"{city_name} {mascot}" in teams:  # names are unique across leagues
                mascot = rng.choice(_MASCOTS)
            team = Team(f"{city_name} {mascot}", league, city_name, f"{mascot} Arena" if rng.random() < 0.5
                        else f"{city_name} Stadium", rng.randint(1890, 2005))
            teams[team.name] = team
            names.append(team.name)
        for day in world_days[::2]:
            order = rng.sample(names, len(names))
            for home, away in zip(order[::2], order[1::2]):
                played = day < today
                top = 6 if league.startswith("Continental") else (130 if "Basketball" in league else 7)
                low = 0 if top < 100 else 80
                hs, as_ = (rng.randint(low, top), rng.randint(low, top)) if played else (None, None)
                games.append(Game(league, day, home, away, hs, as_))

    # Flights: every city pair in a random subset has two or three daily flights.
    flights: dict[str, Flight] = {}
    flight_days: dict = {}
    city_names = sorted(cities)
    routes = rng.sample([(a, b) for a in city_names for b in city_names if a != b], 80)
    for origin, destination in routes:
        distance = great_circle_km(cities[origin], cities[destination])
        for _ in range(rng.randint(2, 3)):
            code = rng.choice(sorted(AIRLINES))
            number = f"{code}{rng.randint(100, 9999)}"
            while number in flights:
                number = f"{code}{rng.randint(100, 9999)}"
            departure = f"{rng.randint(5, 22):02d}:{rng.choice([0, 15, 30, 45]):02d}"
            flights[number] = Flight(number, AIRLINES[code], origin, destination, departure,
                                     int(distance / 820 * 60) + 40)
            base_price = 60 + distance * 0.09
            for day in world_days:
                roll = rng.random()
                status, delay = ("cancelled", 0) if roll < 0.06 else (("delayed", rng.choice([15, 30, 45, 90, 120]))
                                                                      if roll < 0.3 else ("on time", 0))
                flight_days[(number, day)] = FlightDay(status, delay, f"{rng.choice('ABCDE')}{rng.randint(1, 40)}",
                                                       int(base_price * rng.uniform(0.7, 1.6)))

    # Companies and their daily closing prices (trading days only).
    companies: dict[str, Company] = {}
    prices: dict = {}
    used_tickers = set()
    while len(companies) < 10:
        stem = rng.choice(_COMPANY_A) + rng.choice(_COMPANY_B)
        sector = rng.choice(_SECTORS)
        name = f"{stem} {sector}"
        ticker = (stem[:3] + sector[0]).upper()
        if name in companies or ticker in used_tickers:
            continue
        used_tickers.add(ticker)
        companies[name] = Company(name, ticker, sector, rng.choice(city_names), rng.randint(1950, 2018),
                                  _person(rng), rng.randint(2, 400) * 100)
        price = rng.uniform(20, 400)
        for day in world_days:
            if day > today:
                break
            price *= math.exp(rng.gauss(0.0005, 0.02))
            if day.weekday() < 5:
                prices[(ticker, day)] = round(price, 2)

    rates = {code: (rate if code == "USD" else round(rate * rng.uniform(0.95, 1.05), 4))
             for code, rate in CURRENCIES.items()}

    # News: one or two articles per topic per day, built from the world's own entities.
    articles: list[Article] = []
    sources = ["Daily Ledger", "Global Wire", "Morning Post", "The Observer Network"]
    for day in world_days:
        if day > today:
            break
        for topic in NEWS_TOPICS:
            for _ in range(rng.randint(1, 2)):
                articles.append(Article(topic, day, _headline(rng, topic, cities, teams, companies),
                                        rng.choice(sources)))
    return World(seed, today, cities, weather, leagues, teams, games, flights, flight_days, companies,
                 prices, rates, articles)


def _headline(rng, topic, cities, teams, companies) -> str:
    city = rng.choice(sorted(cities))
    company = rng.choice(sorted(companies))
    team = rng.choice(sorted(teams))
    person = _person(rng)
    options = {
        "technology": [f"{company} unveils new AI chip", f"{city} launches city-wide 6G pilot",
                       f"{company} recalls {rng.randint(2, 90)},000 smart speakers"],
        "sports": [f"{team} sign {person} on a {rng.randint(2, 5)}-year deal", f"{team} coach {person} resigns",
                   f"Record crowd at {team} home opener"],
        "politics": [f"{city} mayor {person} wins re-election", f"Parliament debates transport bill in {city}",
                     f"{person} named new foreign minister"],
        "business": [f"{company} shares rise after earnings beat", f"{company} to open headquarters in {city}",
                     f"{company} names {person} chief financial officer"],
        "science": [f"Astronomers in {city} spot new comet", f"{city} lab reports battery breakthrough",
                    f"{person} wins international physics prize"],
        "health": [f"{city} hospitals report flu season peak", f"New clinic opens in {city}",
                   f"Study led by {person} links sleep and memory"],
        "entertainment": [f"{person} to headline {city} music festival", f"Film shot in {city} tops box office",
                          f"{person} announces world tour"],
        "travel": [f"{city} airport opens new terminal", f"Tourism to {city} hits record high",
                   f"Rail strike disrupts travel in {city}"],
    }
    return rng.choice(options[topic])


def random_context(world: World, rng: random.Random) -> EpisodeContext:
    """A user somewhere in the world at some minute of `world.today` (UTC)."""
    minute = rng.randint(0, 24 * 60 - 1)
    now = dt.datetime.combine(world.today, dt.time()) + dt.timedelta(minutes=minute)
    return EpisodeContext(rng.choice(sorted(world.cities)), now)
