"""The vocabulary ToolWorld is generated from: value kinds with their hidden conventions, and domains.

A *kind* says how a value is sampled, how a user says it ("March 5, 2025") and the ways a tool may
want it written (its *conventions*: "2025-03-05", "03/05/2025", "05.03.2025"). Every tool picks one
convention per parameter and documents it in its schema or not. An undocumented convention is what
the request alone leaves ambiguous and what one successful earlier call of the same tool reveals.

A *domain* is a kind of tool (flights, parcels, reminders, ...): tool-name variants, intents users
phrase it with, and its parameters (name variants, kind, the phrase that carries the value).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
CITIES = [("Paris", "PAR"), ("Rome", "ROM"), ("London", "LON"), ("Berlin", "BER"), ("Madrid", "MAD"),
          ("Tokyo", "TYO"), ("Oslo", "OSL"), ("Vienna", "VIE"), ("Lisbon", "LIS"), ("Dublin", "DUB"),
          ("Prague", "PRG"), ("Athens", "ATH"), ("Boston", "BOS"), ("Chicago", "CHI"), ("Denver", "DEN"),
          ("Seattle", "SEA"), ("Toronto", "YTO"), ("Sydney", "SYD"), ("Cairo", "CAI"), ("Zurich", "ZRH")]
FIRST = ["Alice", "Bob", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Irene", "Jonas", "Kate",
         "Liam", "Maya", "Nora", "Omar", "Paula", "Quinn", "Rosa", "Sam", "Tara"]
LAST = ["Smith", "Jones", "Brown", "Garcia", "Miller", "Davis", "Lopez", "Wilson", "Moore", "Clark",
        "Lewis", "Young", "King", "Wright", "Hill", "Scott", "Green", "Adams", "Baker", "Nelson"]
WORDS = ["see you soon", "running late", "call me back", "meeting moved", "thanks a lot", "all done",
         "on my way", "happy birthday", "lunch at noon", "bring the keys", "good luck", "well done"]
ITEMS = ["apples", "rice", "coffee beans", "tomatoes", "olive oil", "oats", "carrots", "cheese"]
REASONS = ["it arrived broken", "wrong size", "never delivered", "changed my mind", "duplicate order"]
CATEGORIES = {
    "cabin": ["economy", "business", "first"],
    "priority": ["low", "medium", "high"],
    "speed": ["standard", "express", "overnight"],
    "size": ["small", "medium", "large"],
    "room": ["single", "double", "suite"],
    "cycle": ["delicate", "normal", "heavy"],
    "mode": ["walking", "cycling", "driving"],
    "level": ["easy", "moderate", "hard"],
    "meal": ["breakfast", "lunch", "dinner"],
    "seat": ["window", "aisle", "middle"],
}
CODE_SETS = [["A", "B", "C"], ["1", "2", "3"], ["X", "Y", "Z"]]


@dataclass(frozen=True)
class Convention:
    name: str
    write: Callable[[Any], Any]  # canonical value -> argument value
    hint: str  # what a tool that documents this convention says in its schema


@dataclass(frozen=True)
class Kind:
    name: str
    json_type: str  # the JSON-schema type of the argument, identical for every convention
    sample: Callable[[random.Random], Any]  # -> canonical value
    say: Callable[[Any], str]  # canonical value -> how a user says it
    conventions: tuple[Convention, ...]

    @property
    def ambiguous(self) -> bool:
        return len(self.conventions) > 1


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _say_duration(minutes: int) -> str:
    if minutes % 60 == 0:
        return f"{minutes // 60} hour" + ("s" if minutes > 60 else "")
    return f"{minutes} minutes"


def _say_time(hm: tuple[int, int]) -> str:
    h, m = hm
    return f"{(h - 1) % 12 + 1}:{m:02d} {'am' if h < 12 else 'pm'}"


KINDS: dict[str, Kind] = {k.name: k for k in [
    Kind("city", "string", lambda r: r.choice(CITIES), lambda c: c[0], (
        Convention("name", lambda c: c[0], "city name"),
        Convention("code", lambda c: c[1], "3-letter city code"))),
    Kind("date", "string", lambda r: (2025, r.randint(1, 12), r.randint(1, 28)),
         lambda d: f"{MONTHS[d[1] - 1]} {d[2]}, {d[0]}", (
        Convention("iso", lambda d: f"{d[0]:04d}-{d[1]:02d}-{d[2]:02d}", "YYYY-MM-DD"),
        Convention("us", lambda d: f"{d[1]:02d}/{d[2]:02d}/{d[0]}", "MM/DD/YYYY"),
        Convention("eu", lambda d: f"{d[2]:02d}.{d[1]:02d}.{d[0]}", "DD.MM.YYYY"))),
    Kind("time", "string", lambda r: (r.randint(6, 21), r.choice([0, 15, 30, 45])), _say_time, (
        Convention("24h", lambda t: f"{t[0]:02d}:{t[1]:02d}", "24-hour HH:MM"),
        Convention("12h", lambda t: f"{(t[0] - 1) % 12 + 1}:{t[1]:02d} {'AM' if t[0] < 12 else 'PM'}",
                   "12-hour H:MM AM/PM"))),
    Kind("duration", "integer", lambda r: r.choice([15, 20, 30, 45, 60, 90, 120, 180]), _say_duration, (
        Convention("minutes", lambda m: m, "in minutes"),
        Convention("seconds", lambda m: m * 60, "in seconds"))),
    Kind("weight", "number", lambda r: r.choice([0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 8, 12]),
         lambda w: f"{_num(w)} kg", (
        Convention("kg", lambda w: _num(w), "in kilograms"),
        Convention("grams", lambda w: int(w * 1000), "in grams"))),
    Kind("distance", "number", lambda r: r.choice([2, 3, 5, 8, 10, 12, 15, 21, 42]),
         lambda d: f"{d} km", (
        Convention("km", lambda d: d, "in kilometres"),
        Convention("meters", lambda d: d * 1000, "in metres"))),
    Kind("money", "number", lambda r: r.choice([5, 12.5, 20, 35.75, 49.99, 80, 120, 250.5]),
         lambda m: f"${m:.2f}" if not float(m).is_integer() else f"${int(m)}", (
        Convention("dollars", lambda m: _num(m), "in dollars"),
        Convention("cents", lambda m: int(round(m * 100)), "in cents"))),
    Kind("temperature", "integer", lambda r: r.choice([5, 10, 15, 20, 25, 30, 40, 60]),
         lambda c: f"{c} degrees Celsius", (
        Convention("celsius", lambda c: c, "in Celsius"),
        Convention("fahrenheit", lambda c: c * 9 // 5 + 32, "in Fahrenheit"))),
    Kind("person", "string", lambda r: (r.choice(FIRST), r.choice(LAST)), lambda p: f"{p[0]} {p[1]}", (
        Convention("first_last", lambda p: f"{p[0]} {p[1]}", "First Last"),
        Convention("last_first", lambda p: f"{p[1]}, {p[0]}", "Last, First"))),
    Kind("record", "string", lambda r: r.randint(1000, 9999), lambda n: str(n), (
        Convention("bare", lambda n: str(n), "digits only"),
        Convention("hash", lambda n: f"#{n}", "#digits"))),
    Kind("count", "integer", lambda r: r.randint(1, 9), str, (Convention("plain", lambda n: n, ""),)),
    Kind("text", "string", lambda r: r.choice(WORDS), lambda s: f"'{s}'", (Convention("plain", lambda s: s, ""),)),
    Kind("item", "string", lambda r: r.choice(ITEMS), str, (Convention("plain", lambda s: s, ""),)),
    Kind("reason", "string", lambda r: r.choice(REASONS), str, (Convention("plain", lambda s: s, ""),)),
    Kind("email", "string", lambda r: f"{r.choice(FIRST).lower()}.{r.choice(LAST).lower()}@example.com",
         str, (Convention("plain", lambda s: s, ""),)),
]}


@dataclass(frozen=True)
class ParamSpec:
    names: tuple[str, ...]  # name variants; a tool uses one
    kind: str  # a key of KINDS, "category:<set>", "flag", "list:<kind>" or "object"
    phrase: str  # how the value appears in a request, "{}" marks it; flags: "on phrase|off phrase"
    required: bool = True
    fields: tuple["ParamSpec", ...] = ()  # for "object": its members


@dataclass(frozen=True)
class Domain:
    tool_names: tuple[str, ...]
    description: str
    intents: tuple[str, ...]
    params: tuple[ParamSpec, ...] = field(default_factory=tuple)


P = ParamSpec
DOMAINS: list[Domain] = [
    Domain(("book_flight", "reserve_flight", "flight_booking", "buy_plane_ticket"), "Book a flight.",
           ("book a flight", "get me a flight", "reserve a plane ticket"),
           (P(("origin", "from_city"), "city", "from {}"), P(("destination", "to_city"), "city", "to {}"),
            P(("date", "departure_date"), "date", "on {}"), P(("cabin", "cabin_class"), "category:cabin", "in {} class"),
            P(("bags", "checked_bags"), "count", "with {} checked bags", required=False))),
    Domain(("book_hotel", "reserve_room", "hotel_booking", "find_lodging"), "Reserve a hotel room.",
           ("book a hotel room", "reserve a room", "find me a hotel"),
           (P(("city", "location"), "city", "in {}"), P(("check_in", "arrival_date"), "date", "from {}"),
            P(("nights", "num_nights"), "count", "for {} nights"), P(("room", "room_type"), "category:room", "a {} room"),
            P(("breakfast", "include_breakfast"), "flag", "with breakfast|without breakfast", required=False))),
    Domain(("ship_parcel", "send_package", "create_shipment", "post_parcel"), "Ship a parcel.",
           ("ship a parcel", "send a package", "mail a box"),
           (P(("weight", "parcel_weight"), "weight", "weighing {}"),
            P(("recipient", "receiver"), "object", "", fields=(
                P(("name", "full_name"), "person", "to {}"), P(("city", "town"), "city", "in {}"))),
            P(("speed", "service"), "category:speed", "with {} delivery"),
            P(("insured", "insurance"), "flag", "with insurance|without insurance", required=False))),
    Domain(("set_reminder", "create_reminder", "add_reminder", "remind_me"), "Create a reminder.",
           ("set a reminder", "remind me", "add a reminder"),
           (P(("date", "day"), "date", "on {}"), P(("time", "at_time"), "time", "at {}"),
            P(("note", "message"), "text", "saying {}"),
            P(("priority", "importance"), "category:priority", "with {} priority", required=False))),
    Domain(("set_thermostat", "adjust_heating", "thermostat_control", "set_temperature"), "Set the thermostat.",
           ("set the thermostat", "change the heating", "adjust the temperature"),
           (P(("temperature", "target"), "temperature", "to {}"), P(("start", "from_time"), "time", "starting at {}"),
            P(("hold", "hold_for"), "duration", "for {}", required=False))),
    Domain(("send_payment", "transfer_money", "pay_person", "make_transfer"), "Send money to someone.",
           ("send money", "pay someone", "transfer funds"),
           (P(("amount", "sum"), "money", "of {}"), P(("payee", "to_person"), "person", "to {}"),
            P(("memo", "reference"), "text", "with the memo {}", required=False))),
    Domain(("book_table", "reserve_table", "restaurant_booking", "dinner_reservation"), "Reserve a restaurant table.",
           ("book a table", "reserve a table", "get a restaurant table"),
           (P(("guests", "party_size"), "count", "for {} people"), P(("date", "day"), "date", "on {}"),
            P(("time", "at_time"), "time", "at {}"), P(("meal", "service"), "category:meal", "for {}"),
            P(("seating", "seat"), "category:seat", "with a {} seat", required=False))),
    Domain(("rent_car", "car_rental", "reserve_car", "hire_car"), "Rent a car.",
           ("rent a car", "hire a car", "reserve a rental car"),
           (P(("city", "pickup_city"), "city", "in {}"), P(("pickup_date", "start_date"), "date", "from {}"),
            P(("days", "num_days"), "count", "for {} days"), P(("size", "car_size"), "category:size", "a {} car"))),
    Domain(("log_run", "record_run", "add_workout", "track_run"), "Log a run.",
           ("log a run", "record my run", "track a workout"),
           (P(("distance", "length"), "distance", "of {}"), P(("duration", "time_taken"), "duration", "in {}"),
            P(("level", "effort"), "category:level", "at {} effort"))),
    Domain(("track_order", "order_status", "lookup_order", "find_order"), "Look up an order.",
           ("track my order", "check on order", "look up order"),
           (P(("order_id", "order"), "record", "number {}"),
            P(("notify", "email"), "email", "and email {}", required=False))),
    Domain(("open_ticket", "create_ticket", "file_support_case", "report_issue"), "Open a support ticket.",
           ("open a support ticket", "report a problem", "file a ticket"),
           (P(("account", "account_id"), "record", "for account {}"), P(("priority", "urgency"), "category:priority", "with {} priority"),
            P(("summary", "title"), "text", "titled {}"))),
    Domain(("run_washer", "start_laundry", "washing_machine", "wash_clothes"), "Start the washing machine.",
           ("start the washer", "run the laundry", "wash my clothes"),
           (P(("cycle", "program"), "category:cycle", "on the {} cycle"), P(("temperature", "water_temp"), "temperature", "at {}"),
            P(("duration", "run_time"), "duration", "for {}", required=False))),
    Domain(("plan_route", "get_directions", "route_planner", "navigate_to"), "Plan a route.",
           ("plan a route", "get directions", "find the way"),
           (P(("destination", "to_city"), "city", "to {}"), P(("mode", "travel_mode"), "category:mode", "by {}"),
            P(("depart", "departure_time"), "time", "leaving at {}"))),
    Domain(("schedule_meeting", "book_meeting", "create_event", "calendar_invite"), "Schedule a meeting.",
           ("schedule a meeting", "set up a meeting", "book a meeting"),
           (P(("attendees", "participants"), "list:person", "with {}"), P(("date", "day"), "date", "on {}"),
            P(("length", "duration"), "duration", "lasting {}"))),
    Domain(("order_groceries", "buy_produce", "grocery_order", "shop_food"), "Order groceries.",
           ("order groceries", "buy some produce", "get groceries"),
           (P(("item", "product"), "item", "namely {}"), P(("weight", "quantity"), "weight", "of {}"),
            P(("budget", "max_price"), "money", "for at most {}", required=False))),
    Domain(("refund_order", "request_refund", "issue_refund", "return_item"), "Request a refund.",
           ("request a refund", "get my money back", "refund an order"),
           (P(("order_id", "order"), "record", "for order {}"), P(("amount", "value"), "money", "of {}"),
            P(("reason", "note"), "reason", "because {}", required=False))),
]
