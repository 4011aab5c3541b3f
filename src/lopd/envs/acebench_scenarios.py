"""The simulated phone of ACEBench's `agent_multi_step` rows: device switches, messages, reminders, food delivery.

    phone = Phone(("BaseApi", "MessageApi"), {"BaseApi": {"wifi": False, "logged_in": True}})
    phone.call("turn_on_wifi", {})              # {"status": True, "message": "Wi-Fi is on."}
    phone.call("get_latest_message_id", {})     # {"status": True, "message_id": 4, "message": "..."}
    phone.state()                               # {"BaseApi": {"wifi": True, ...}, "MessageApi": {"inbox": {...}}}

Our own implementation of the behaviour the rows rely on. The public ACEBench repository's scenario classes
were read to learn that behaviour (which checks each function makes, in which order, what it changes); none
of their code is reused. One `Phone` per episode holds the apps a row names in `involved_classes`; a call is
dispatched by function name to the app that owns it. `state()` gives, per app, exactly the attributes the
benchmark compares with its ground truth (BaseApi: wifi, logged_in; MessageApi: inbox; ReminderApi:
reminder_list; FoodPlatform: users, logged_in_users, orders), JSON-shaped (ids as string keys), because the
released evaluator compares states after a JSON round trip.

Rules (each one is what the rows' ground truths and milestones need, and what the benchmark does):
- The device's Wi-Fi and login come from `initial_config["BaseApi"]` (missing: Wi-Fi off, logged in) and are
  shared by every app (upstream each app holds a copy and turn_on_wifi / login_device switch all of them).
- Messages: sending needs the device logged in, Wi-Fi, room (fewer than 6 messages) and two known users;
  a new message takes the next id after the highest ever used (ids are not reused) and has no time. Deleting,
  viewing and the latest/earliest queries need the device logged in; searching needs nothing. "Latest" and
  "earliest" order messages by their date, not their id; a message without a date makes them fail (the
  benchmark's own query raises there).
- Reminders: viewing and adding need the device logged in; adding needs room (fewer than 6); a new reminder's
  key and `reminder_id` are the next number after the highest key ever used.
- Food delivery: logging in needs Wi-Fi and the right password, and fails for a user already logged in;
  ordering needs the user logged in to the platform (not the device, not Wi-Fi), a known merchant, every
  product on its menu with a positive integer quantity (default 1), and enough balance; it deducts the total.
- `search_reminders` is listed in the rows' function schemas but the benchmark's reminder app has no such
  function, so a call gets an error there; it gets one here too. Functions the schemas do not list are not
  callable (upstream every public method of an involved app was).

Default state and where each part comes from (the English data, `data_agent_multi_step.json` and its answers;
"GT" = a row's ground-truth end state, "MS" = its milestone calls):
- Food users, passwords, user ids: every GT's `users`; start balances: a balance untouched in some GT (every
  user keeps its start balance in the rows where it orders nothing), consistent with end = start - order total
  in the rows where it orders (Eve 500 - 88 = 412, Jack 120 - 78 = 42, Isaac 400 - 80 = 320, Helen 800 - 22 = 778,
  Eve 500 - 198 = 302).
- Menu prices: the GT orders' `price_per_unit` (Super Supreme Pizza 88, Grilled Pork Belly 78, Stone Pot
  Bibimbap 35, Korean Beef Bibimbap 45, Four Seasons Spring Milk Tea 22, Fresh Gift Pack 99) and, from the
  `agent_multi_turn` answers, Margherita Pizza 68. The data needs one more item at two merchants and does not
  price it: row 2's "I only have 120 yuan ... order one that I can afford" needs a Jiutian BBQ dish over 120,
  and the message asking for "a cheaper milk tea" needs a dearer Heytea tea. For those (and Hema Fresh's
  second item) we use what the benchmark's `get_products` answers: Korean Grilled Beef 128, Cheese Milk Tea 25,
  Organic Vegetable Pack 15. Its sixth merchant (Haidilao) appears in no row and is left out.
- Messages 1-3, 5, 6 and their dates: row 4's GT inbox; message 4: row 18's GT (the other rows delete it).
  User ids USR100-USR105: the GT senders and receivers of the messages sent in the MS (Eve -> Frank is
  USR100 -> USR101, Isaac USR104, Helen -> Grace USR103 -> USR102); Jack is the remaining USR105 (messages 5
  and 6 are Isaac and Jack talking). Capacity 6: row 4's question calls an inbox of 6 full, and row 18 sends
  with 5 messages left.
- Reminders 1001-1003: rows 14-17's GT. Rows 0-1's GT (class spelt "ReminderAPI") holds only 1001 and 1002
  plus the new reminder numbered 3, so their phone starts without the "To-do list" (see `Phone`'s `todo_list`).
  The reminder capacity (6) is the benchmark's; no row reaches it.
"""

from __future__ import annotations

import copy
import inspect
import json
from datetime import datetime
from typing import Any, Callable, Mapping, Sequence

CLASSES = ("BaseApi", "MessageApi", "ReminderApi", "FoodPlatform")

# --------------------------------------------------------------------------------- default data

FOOD_USERS = {  # name -> {user_id, password, balance}
    "Eve": {"user_id": "U100", "password": "password123", "balance": 500.0},
    "Frank": {"user_id": "U101", "password": "password456", "balance": 300.0},
    "Grace": {"user_id": "U102", "password": "password789", "balance": 150.0},
    "Helen": {"user_id": "U103", "password": "password321", "balance": 800.0},
    "Isaac": {"user_id": "U104", "password": "password654", "balance": 400.0},
    "Jack": {"user_id": "U105", "password": "password654", "balance": 120.0},
}
MENUS = {  # merchant -> [{product, price}]; the items marked "not in the data" are the benchmark's (see above)
    "Domino's": [{"product": "Margherita Pizza", "price": 68.0}, {"product": "Super Supreme Pizza", "price": 88.0}],
    "Rice Village Bibimbap": [{"product": "Stone Pot Bibimbap", "price": 35.0},
                              {"product": "Korean Beef Bibimbap", "price": 45.0}],
    "Heytea": [{"product": "Cheese Milk Tea", "price": 25.0},  # not in the data
               {"product": "Four Seasons Spring Milk Tea", "price": 22.0}],
    "Hema Fresh": [{"product": "Organic Vegetable Pack", "price": 15.0},  # not in the data
                   {"product": "Fresh Gift Pack", "price": 99.0}],
    "Jiutian BBQ": [{"product": "Korean Grilled Beef", "price": 128.0},  # not in the data
                    {"product": "Grilled Pork Belly", "price": 78.0}],
}
MESSAGE_USERS = {"Eve": "USR100", "Frank": "USR101", "Grace": "USR102", "Helen": "USR103", "Isaac": "USR104",
                 "Jack": "USR105"}
INBOX = {  # id -> {sender_id, receiver_id, message, time (YYYY-MM-DD)}
    1: {"sender_id": "USR100", "receiver_id": "USR101",
        "message": "Hey Frank, don't forget about our meeting on 2024-06-11 at 4 PM in Conference Room 1.",
        "time": "2024-06-09"},
    2: {"sender_id": "USR101", "receiver_id": "USR102",
        "message": "Can you help me order a \"Margherita Pizza\" delivery? The merchant is Domino's.",
        "time": "2024-03-09"},
    3: {"sender_id": "USR102", "receiver_id": "USR103",
        "message": "Please check the milk tea delivery options available from Heytea and purchase a cheaper milk tea "
                   "for me. After making the purchase, remember to reply to me with \"Already bought.\"",
        "time": "2023-12-05"},
    4: {"sender_id": "USR103", "receiver_id": "USR102", "message": "No problem Helen, I can assist you.",
        "time": "2024-09-09"},
    5: {"sender_id": "USR104", "receiver_id": "USR105", "message": "Isaac, are you available for a call?",
        "time": "2024-06-06"},
    6: {"sender_id": "USR105", "receiver_id": "USR104", "message": "Yes Jack, let's do it in 30 minutes.",
        "time": "2024-01-15"},
}
TODO_LIST = ("First, help Frank place a food delivery order at \"Hema Fresh,\" ordering two \"Fresh Gift Packs.\" "
             "Then, send a message to Frank saying, \"The price of the purchased goods is () yuan.\" Replace the "
             "parentheses with the actual amount, keeping one decimal place.")
REMINDERS = {  # key -> {reminder_id, title, description, time (YYYY-MM-DD HH:MM), notified}
    1: {"reminder_id": 1001, "title": "Doctor's Appointment", "description": "Visit Dr. Smith for a checkup.",
        "time": "2024-07-15 09:30", "notified": False},
    2: {"reminder_id": 1002, "title": "Team Meeting", "description": "Monthly project review with the team.",
        "time": "2024-07-17 11:00", "notified": False},
    3: {"reminder_id": 1003, "title": "To-do list", "description": TODO_LIST, "time": "2024-07-16 11:00",
        "notified": False},
}
MESSAGE_CAPACITY = 6
REMINDER_CAPACITY = 6


def jsonable(value: Any) -> Any:
    """`value` in the shapes JSON holds: tuples as lists, a key JSON cannot hold as its repr, and any other
    object (a set, bytes, ...) as its repr. Arguments come from model output and may be any Python literal."""
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else repr(k): jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def ok(message: str, **extra: Any) -> dict:
    return {"status": True, "message": message, **extra}


def failed(message: str) -> dict:
    return {"status": False, "message": message}


# ------------------------------------------------------------------------------------------ apps


class Device:
    """BaseApi: the phone's Wi-Fi and login switches, shared by every app."""

    name = "BaseApi"
    saved = ("wifi", "logged_in")
    functions = ("turn_on_wifi", "login_device")

    def __init__(self, wifi: bool, logged_in: bool):
        self.wifi = wifi
        self.logged_in = logged_in

    def turn_on_wifi(self) -> dict:
        self.wifi = True
        return ok("Wi-Fi is on.")

    def login_device(self) -> dict:
        self.logged_in = True
        return ok("The device is logged in.")


class Messages:
    """MessageApi: an inbox of at most 6 messages between six known users."""

    name = "MessageApi"
    saved = ("inbox",)
    functions = ("send_message", "delete_message", "view_messages_between_users", "search_messages",
                 "get_latest_message_id", "get_earliest_message_id")

    def __init__(self, device: Device):
        self.device = device
        self.users = dict(MESSAGE_USERS)
        self.inbox: dict[int, dict] = copy.deepcopy(INBOX)
        self.last_id = max(self.inbox)

    def send_message(self, sender_name: str, receiver_name: str, message: str) -> dict:
        if not self.device.logged_in:
            return failed("The device is not logged in, so no message can be sent.")
        if not self.device.wifi:
            return failed("Wi-Fi is off, so no message can be sent.")
        if len(self.inbox) >= MESSAGE_CAPACITY:
            return failed("The inbox is full: a message has to be deleted first.")
        if sender_name not in self.users or receiver_name not in self.users:
            return failed("The sender or the receiver does not exist.")
        self.last_id += 1
        self.inbox[self.last_id] = {"sender_id": self.users[sender_name], "receiver_id": self.users[receiver_name],
                                    "message": message}
        return ok(f"Message sent to {receiver_name}.")

    def delete_message(self, message_id: int) -> dict:
        if not self.device.logged_in:
            return failed("The device is not logged in, so no message can be deleted.")
        if message_id not in self.inbox:
            return failed(f"There is no message with ID {message_id}.")
        del self.inbox[message_id]
        return ok(f"Message {message_id} deleted.")

    def view_messages_between_users(self, sender_name: str, receiver_name: str) -> dict:
        if not self.device.logged_in:
            return failed("The device is not logged in, so messages cannot be viewed.")
        if sender_name not in self.users:
            return failed("The sender does not exist.")
        if receiver_name not in self.users:
            return failed("The receiver does not exist.")
        sender, receiver = self.users[sender_name], self.users[receiver_name]
        found = [{"id": i, "sender": sender_name, "receiver": receiver_name, "message": m["message"]}
                 for i, m in self.inbox.items() if m["sender_id"] == sender and m["receiver_id"] == receiver]
        if not found:
            return failed(f"No messages from {sender_name} to {receiver_name}.")
        return {"status": True, "messages": found}

    def search_messages(self, user_name: str, keyword: str) -> dict:
        if user_name not in self.users:
            return failed("The user does not exist.")
        user = self.users[user_name]
        found = [{"id": i, "sender_id": m["sender_id"], "receiver_id": m["receiver_id"], "message": m["message"]}
                 for i, m in self.inbox.items()
                 if user in (m["sender_id"], m["receiver_id"]) and keyword.lower() in m["message"].lower()]
        if not found:
            return failed(f"No message of {user_name} contains '{keyword}'.")
        return {"status": True, "messages": found}

    def get_latest_message_id(self) -> dict:
        return self._by_date("latest", max)

    def get_earliest_message_id(self) -> dict:
        return self._by_date("earliest", min)

    def _by_date(self, which: str, pick: Callable) -> dict:
        """The id of the message with the latest (`max`) or earliest (`min`) date; the first one on a tie."""
        if not self.device.logged_in:
            return failed(f"The device is not logged in, so the {which} message cannot be found.")
        if not self.inbox:
            return failed("The inbox is empty.")
        undated = [i for i, m in self.inbox.items() if "time" not in m]
        if undated:
            return failed(f"Message {undated[0]} has no date, so messages cannot be ordered by date.")
        chosen = pick(self.inbox, key=lambda i: datetime.strptime(self.inbox[i]["time"], "%Y-%m-%d"))
        return ok(f"The {which} message has ID {chosen}.", message_id=chosen)


class Reminders:
    """ReminderApi: at most 6 reminders, found by exact title."""

    name = "ReminderApi"
    saved = ("reminder_list",)
    functions = ("view_reminder_by_title", "add_reminder")

    def __init__(self, device: Device, todo_list: bool = True):
        self.device = device
        self.reminder_list: dict[int, dict] = copy.deepcopy(
            REMINDERS if todo_list else {k: v for k, v in REMINDERS.items() if v["title"] != "To-do list"})
        self.last_id = max(self.reminder_list)

    def view_reminder_by_title(self, title: str) -> dict:
        if not self.device.logged_in:
            return failed("The device is not logged in, so reminders cannot be viewed.")
        for reminder in self.reminder_list.values():
            if reminder["title"] == title:
                return {"status": True, "reminder": copy.deepcopy(reminder)}
        return failed(f"No reminder is titled '{title}'.")

    def add_reminder(self, title: str, description: str, time: str) -> dict:
        if not self.device.logged_in:
            return failed("The device is not logged in, so no reminder can be added.")
        if len(self.reminder_list) >= REMINDER_CAPACITY:
            return failed("The reminder list is full.")
        self.last_id += 1
        self.reminder_list[self.last_id] = {"reminder_id": self.last_id, "title": title, "description": description,
                                            "time": time, "notified": False}
        return ok(f"Reminder '{title}' added.")


class Food:
    """FoodPlatform: six users with balances, five merchants with menus, delivery orders."""

    name = "FoodPlatform"
    saved = ("users", "logged_in_users", "orders")
    functions = ("login_food_platform", "check_balance", "add_food_delivery_order", "get_products")

    def __init__(self, device: Device):
        self.device = device
        self.users: dict[str, dict] = copy.deepcopy(FOOD_USERS)
        self.menus: dict[str, list[dict]] = copy.deepcopy(MENUS)
        self.logged_in_users: list[str] = []
        self.orders: list[dict] = []

    def login_food_platform(self, username: str, password: str) -> dict:
        if not self.device.wifi:
            return failed("Wi-Fi is off, so the platform cannot be reached.")
        if username not in self.users:
            return failed("The user does not exist.")
        if self.users[username]["password"] != password:
            return failed("Wrong password.")
        if username in self.logged_in_users:
            return failed(f"{username} is already logged in.")
        self.logged_in_users.append(username)
        return ok(f"{username} is logged in to the food platform.")

    def check_balance(self, user_name: str) -> float:
        """The user's balance; 0.0 for an unknown user (the benchmark's answer too)."""
        return self.users[user_name]["balance"] if user_name in self.users else 0.0

    def get_products(self, merchant_name: str) -> list[dict] | dict:
        if merchant_name not in self.menus:
            return failed(f"There is no merchant named '{merchant_name}'.")
        return copy.deepcopy(self.menus[merchant_name])

    def add_food_delivery_order(self, username: str, merchant_name: str, items: list[dict]) -> dict:
        if username not in self.logged_in_users:
            return failed(f"{username} is not logged in to the food platform.")
        if merchant_name not in self.menus:
            return failed(f"There is no merchant named '{merchant_name}'.")
        prices = {p["product"]: p["price"] for p in self.menus[merchant_name]}
        total, lines = 0.0, []
        for item in items:  # each {product, quantity}
            product, quantity = item.get("product"), item.get("quantity", 1)
            if not isinstance(quantity, int) or quantity <= 0:
                return failed(f"Invalid quantity {quantity!r} for {product!r}.")
            if product not in prices:
                return failed(f"{merchant_name} has no product named {product!r}.")
            total += prices[product] * quantity
            lines.append({"product": product, "quantity": quantity, "price_per_unit": prices[product]})
        if total > self.users[username]["balance"]:
            return failed("The balance is too low for this order.")
        self.users[username]["balance"] -= total
        self.orders.append({"user_name": username, "merchant_name": merchant_name, "items": lines,
                            "total_price": total})
        return ok(f"Order placed with {merchant_name}; the total is {total} yuan.")


# ----------------------------------------------------------------------------------------- phone


class Phone:
    """The apps of one row on one device, and the dispatch of calls to them.

    `involved`: the row's `involved_classes` (names in CLASSES); `initial_config`: its `initial_config`;
    `allowed`: the function names the row lists (None: every function of the apps); `todo_list`: whether the
    reminder app starts with the "To-do list" reminder (see the module docstring).
    """

    def __init__(self, involved: Sequence[str], initial_config: Mapping[str, Any], *,
                 allowed: Sequence[str] | None = None, todo_list: bool = True):
        unknown = [name for name in involved if name not in CLASSES]
        if unknown:
            raise ValueError(f"no simulated app for {', '.join(unknown)} (apps: {', '.join(CLASSES)})")
        base = initial_config.get("BaseApi", {})
        self.device = Device(wifi=bool(base.get("wifi", False)), logged_in=bool(base.get("logged_in", True)))
        self.apps: dict[str, Any] = {}
        for name in dict.fromkeys(involved):
            if name == "BaseApi":
                self.apps[name] = self.device
            elif name == "ReminderApi":
                self.apps[name] = Reminders(self.device, todo_list=todo_list)
            else:
                self.apps[name] = {"MessageApi": Messages, "FoodPlatform": Food}[name](self.device)
        self.owner: dict[str, Any] = {fn: self.device for fn in Device.functions}  # every app has the switches
        for app in self.apps.values():
            self.owner.update({fn: app for fn in app.functions})
        self.allowed = None if allowed is None else frozenset(allowed)

    def call(self, name: str, arguments: Mapping[str, Any]) -> Any:
        """Run one call; what the function returns, or {"error": sentence} when it cannot run at all."""
        if self.allowed is not None and name not in self.allowed:
            return {"error": f"'{name}' is not one of the available functions."}
        if name not in self.owner:
            return {"error": f"'{name}' cannot be executed in this scenario."}
        method = getattr(self.owner[name], name)
        try:
            inspect.signature(method).bind(**arguments)
        except TypeError as e:
            return {"error": f"{name}: {e}."}
        try:
            return method(**arguments)
        except (TypeError, ValueError, AttributeError, KeyError) as e:  # values of the wrong type
            return {"error": f"{name} failed: {type(e).__name__}: {e}."}

    def state(self) -> dict[str, dict]:
        """{class name: {attribute: value}} for the involved apps, JSON-shaped (integer keys become strings)."""
        raw = {name: {attr: getattr(app, attr) for attr in app.saved} for name, app in self.apps.items()}
        return json.loads(json.dumps(jsonable(raw)))
