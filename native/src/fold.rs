//! The fold's per-event path, compiled: `FoldCore.apply` does what `Fold._apply` (processors/ledger/fold.py) does
//! for the events that make up almost every stream (ChildReserved, ChildActivated, UsageReported, ChildCompleted,
//! the outcomes with known usage, SpeculativeWinner, ParentReserved and ParentClosed), over the same records (the
//! LedgerView's dicts) and through the same view, so the state, the checkpoint and the changelog are those of the
//! Python fold. Every other event, a Tick, an event the quick validation does not pass, an event of another
//! partition, and the rare branches of these handlers (a reservation that would recall loans, a close that must ask
//! loans back) go to `Fold._apply` before anything has changed: the Python fold stays the reference, and the two are
//! held to the same bytes by tests/ledger/test_implementations_agree.py and the whole suite, which runs compiled.
//!
//! Each step below names the Python function it mirrors (processors/ledger/handlers.py, accounting.py, fold.py,
//! context.py, validation.py). The contract's names and limits are not defined here: `FoldCore` is given them by
//! fold.py and refuses to start if they differ from the ones this code was written for.

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString};

use crate::outputs::{output_key, Direct, OutLists};

// Child states (projections/model.py).
const RESERVED: &str = "reserved";
const ACTIVATED: &str = "activated";
const PARTIALLY_CONSUMED: &str = "partially_consumed";
const CANCEL_REQUESTED: &str = "cancel_requested";
const EXPIRED: &str = "expired";
const RECONCILING: &str = "reconciling";
const STRANDED: &str = "stranded";
const COMMITTED: &str = "committed";
const RELEASED: &str = "released";
// Parent status.
const PARENT_OPEN: &str = "open";
const PARENT_CLOSING: &str = "closing";
const PARENT_EXPIRED: &str = "expired";
const PARENT_CLOSED: &str = "closed";
const PHYSICAL: &str = "physical";
const LOAN_OPEN: &str = "open";
const DESTINATION_PARENT: &str = "parent";
const DESTINATION_POOL: &str = "global_pool";
const TIMER_CHILD_LEASE: &str = "child_lease";
const TIMER_PARENT_RETENTION: &str = "parent_retention";

// Result codes (processors/ledger/results.py).
const OK: &str = "ok";
const DUPLICATE: &str = "duplicate";
const IDEMPOTENCY_CONFLICT: &str = "idempotency_conflict";
const OVERDRAWN: &str = "overdrawn";
const EXCEEDS_AVAILABLE: &str = "exceeds_available";
const FANOUT_EXCEEDED: &str = "fanout_exceeded";
const INVALID_TRANSITION: &str = "invalid_transition";
const DISPATCH_FENCED: &str = "dispatch_fenced";
const STALE_LEASE_GENERATION: &str = "stale_lease_generation";
const SUPERSEDED_ATTEMPT: &str = "superseded_attempt";
const UNKNOWN_PARENT: &str = "unknown_parent";
const UNKNOWN_CHILD: &str = "unknown_child";
const PARENT_CLOSED_CODE: &str = "parent_closed";
const ALREADY_SETTLED: &str = "already_settled";
const INVALID_EVENT: &str = "invalid_event";
const DUPLICATE_USAGE_REPORT: &str = "duplicate_usage_report";
const LIMIT_EXCEEDED: &str = "limit_exceeded";

// The kinds of a dimension (model.DIMENSION_KINDS).
const LOGICAL: &str = "logical";
const DIMENSION_KINDS: &[&str] = &[LOGICAL, PHYSICAL];
const TIMER_PARENT_LEASE: &str = "parent_lease";
// What a ParentClosed may say of the workflow (validation.PARENT_OUTCOMES).
const PARENT_OUTCOMES: &[&str] = &["cancelled", "failed", "succeeded"];

// Limits (schemas/limits.py).
const MAX_ID_BYTES: usize = 200;
const MAX_KEY_BYTES: usize = 1024;
const MAX_DIMENSIONS: usize = 32;
const MAX_QUANTITY: i64 = 1 << 50;
const MAX_TTL_MS: i64 = 1 << 42;
const MAX_LEASE_GENERATION: i64 = 1 << 31;
const MAX_CHILDREN_PER_PARENT: usize = 1024;
const MAX_USAGE_REPORTS_PER_ATTEMPT: usize = 1024;
const MAX_BALANCE: i64 = 1 << 62;

// The LedgerView's keys (projections/keys.py), record names and estimate of a new record (projections/view.py).
const KEY_SEP: &str = "\0";
const KEY_PARENT: &str = "p";
const KEY_CHILD: &str = "c";
const KEY_IDEMPOTENCY: &str = "i";
const PARENT_RECORD: &str = "LedgerParent";
const CHILD_RECORD: &str = "LedgerChild";
const IDEMPOTENCY_RECORD: &str = "IdempotencyRecord";
const KEY_TIMER: &str = "t";
const DEADLINE_DIGITS: usize = 16;
const TIMER_RECORD: &str = "TimerRecord";
const NEW_RECORD_BYTES: i64 = 1024;
const ENTRY_BYTES: i64 = 400;
/// The record keys an event keeps to use again (Ctx::key_object): its idempotency record, parent and child.
const KEYS_KEPT: usize = 4;

/// What fold.py checks at start: each of its names and limits, as this code has them.
const CONTRACT: &[(&str, Value)] = &[
    ("RESERVED", Value::S(RESERVED)), ("ACTIVATED", Value::S(ACTIVATED)),
    ("PARTIALLY_CONSUMED", Value::S(PARTIALLY_CONSUMED)), ("CANCEL_REQUESTED", Value::S(CANCEL_REQUESTED)),
    ("EXPIRED", Value::S(EXPIRED)), ("RECONCILING", Value::S(RECONCILING)), ("STRANDED", Value::S(STRANDED)),
    ("COMMITTED", Value::S(COMMITTED)), ("RELEASED", Value::S(RELEASED)), ("PARENT_OPEN", Value::S(PARENT_OPEN)),
    ("PARENT_CLOSING", Value::S(PARENT_CLOSING)), ("PARENT_EXPIRED", Value::S(PARENT_EXPIRED)),
    ("PARENT_CLOSED", Value::S(PARENT_CLOSED)), ("PHYSICAL", Value::S(PHYSICAL)), ("LOAN_OPEN", Value::S(LOAN_OPEN)),
    ("DESTINATION_PARENT", Value::S(DESTINATION_PARENT)), ("DESTINATION_POOL", Value::S(DESTINATION_POOL)),
    ("TIMER_CHILD_LEASE", Value::S(TIMER_CHILD_LEASE)), ("TIMER_PARENT_RETENTION", Value::S(TIMER_PARENT_RETENTION)),
    ("OK", Value::S(OK)), ("DUPLICATE", Value::S(DUPLICATE)), ("IDEMPOTENCY_CONFLICT", Value::S(IDEMPOTENCY_CONFLICT)),
    ("OVERDRAWN", Value::S(OVERDRAWN)), ("EXCEEDS_AVAILABLE", Value::S(EXCEEDS_AVAILABLE)),
    ("FANOUT_EXCEEDED", Value::S(FANOUT_EXCEEDED)), ("INVALID_TRANSITION", Value::S(INVALID_TRANSITION)),
    ("DISPATCH_FENCED", Value::S(DISPATCH_FENCED)), ("STALE_LEASE_GENERATION", Value::S(STALE_LEASE_GENERATION)),
    ("SUPERSEDED_ATTEMPT", Value::S(SUPERSEDED_ATTEMPT)), ("UNKNOWN_PARENT", Value::S(UNKNOWN_PARENT)),
    ("UNKNOWN_CHILD", Value::S(UNKNOWN_CHILD)), ("PARENT_CLOSED_CODE", Value::S(PARENT_CLOSED_CODE)),
    ("ALREADY_SETTLED", Value::S(ALREADY_SETTLED)), ("INVALID_EVENT", Value::S(INVALID_EVENT)),
    ("DUPLICATE_USAGE_REPORT", Value::S(DUPLICATE_USAGE_REPORT)), ("LIMIT_EXCEEDED", Value::S(LIMIT_EXCEEDED)),
    ("MAX_ID_BYTES", Value::I(MAX_ID_BYTES as i64)), ("MAX_KEY_BYTES", Value::I(MAX_KEY_BYTES as i64)),
    ("MAX_DIMENSIONS", Value::I(MAX_DIMENSIONS as i64)), ("MAX_QUANTITY", Value::I(MAX_QUANTITY)),
    ("MAX_TTL_MS", Value::I(MAX_TTL_MS)), ("MAX_LEASE_GENERATION", Value::I(MAX_LEASE_GENERATION)),
    ("MAX_CHILDREN_PER_PARENT", Value::I(MAX_CHILDREN_PER_PARENT as i64)),
    ("MAX_USAGE_REPORTS_PER_ATTEMPT", Value::I(MAX_USAGE_REPORTS_PER_ATTEMPT as i64)),
    ("MAX_BALANCE", Value::I(MAX_BALANCE)),
    ("KEY_SEP", Value::S(KEY_SEP)), ("KEY_PARENT", Value::S(KEY_PARENT)), ("KEY_CHILD", Value::S(KEY_CHILD)),
    ("KEY_IDEMPOTENCY", Value::S(KEY_IDEMPOTENCY)), ("PARENT_RECORD", Value::S(PARENT_RECORD)),
    ("CHILD_RECORD", Value::S(CHILD_RECORD)), ("IDEMPOTENCY_RECORD", Value::S(IDEMPOTENCY_RECORD)),
    ("NEW_RECORD_BYTES", Value::I(NEW_RECORD_BYTES)), ("ENTRY_BYTES", Value::I(ENTRY_BYTES)),
    ("KEY_TIMER", Value::S(KEY_TIMER)), ("DEADLINE_DIGITS", Value::I(DEADLINE_DIGITS as i64)),
    ("TIMER_RECORD", Value::S(TIMER_RECORD)), ("PARENT_OUTCOMES", Value::S("cancelled,failed,succeeded")),
    ("LOGICAL", Value::S(LOGICAL)), ("TIMER_PARENT_LEASE", Value::S(TIMER_PARENT_LEASE)),
];

static HEAPPUSH: pyo3::sync::GILOnceCell<Py<PyAny>> = pyo3::sync::GILOnceCell::new();

enum Value {
    S(&'static str),
    I(i64),
}

/// The fields of a result and of an audit record, as the slots the core gives their writers (Encoder::slot_order) when
/// it writes them itself (FoldCore::apply_with).
pub(crate) const RESULT_SLOTS: [&str; 10] = [
    "event_id", "idempotency_key", "parent_id", "child_id", "event_type", "result", "detail", "input_partition",
    "input_offset", "ledger_time_ms",
];
pub(crate) const AUDIT_SLOTS: [&str; 15] = [
    "parent_id", "child_id", "attempt_id", "dimension", "quantity", "prior_state", "new_state", "idempotency_key",
    "lease_generation", "triggering_event_id", "event_type", "input_partition", "input_offset", "ledger_time_ms",
    "note",
];
/// The fields of a release, in the order Ctx::release holds their values.
pub(crate) const RELEASE_SLOTS: [&str; 14] = [
    "release_key", "parent_id", "child_id", "attempt_id", "dimension", "quantity", "destination", "reason",
    "idempotency_key", "triggering_event_id", "balance", "input_partition", "input_offset", "ledger_time_ms",
];

/// The fields of an idempotency record, as the slots its writer finds them in (Ctx::put_idempotency).
const IDEMPOTENCY_SLOTS: [&str; 4] = ["payload_digest", "event_type", "result", "event_id"];
/// The fields of a timer record, in the order Ctx::add_timer holds their values.
const TIMER_SLOTS: [&str; 4] = ["kind", "deadline_ms", "parent_id", "child_id"];

static IDEMPOTENCY_KEYS: pyo3::sync::GILOnceCell<Vec<Py<PyString>>> = pyo3::sync::GILOnceCell::new();

/// An idempotency record of `values` (in IDEMPOTENCY_SLOTS' order) as a dict.
fn idempotency_dict<'py>(py: Python<'py>, values: &[Bound<'py, PyAny>; 4]) -> PyResult<Bound<'py, PyDict>> {
    slots_dict(py, &IDEMPOTENCY_KEYS, &IDEMPOTENCY_SLOTS, values)
}

static TIMER_KEYS: pyo3::sync::GILOnceCell<Vec<Py<PyString>>> = pyo3::sync::GILOnceCell::new();

/// A timer record of `values` (in TIMER_SLOTS' order, the order LedgerView.add_timer writes them in) as a dict.
fn timer_dict<'py>(py: Python<'py>, values: &[Bound<'py, PyAny>; 4]) -> PyResult<Bound<'py, PyDict>> {
    slots_dict(py, &TIMER_KEYS, &TIMER_SLOTS, values)
}

static RESULT_KEYS: pyo3::sync::GILOnceCell<Vec<Py<PyString>>> = pyo3::sync::GILOnceCell::new();
static AUDIT_KEYS: pyo3::sync::GILOnceCell<Vec<Py<PyString>>> = pyo3::sync::GILOnceCell::new();
static RELEASE_KEYS: pyo3::sync::GILOnceCell<Vec<Py<PyString>>> = pyo3::sync::GILOnceCell::new();

/// A record of `values` as a dict, under `names` (RESULT_SLOTS or AUDIT_SLOTS, interned once in `keys`), in that order.
fn slots_dict<'py>(py: Python<'py>, keys: &'static pyo3::sync::GILOnceCell<Vec<Py<PyString>>>, names: &[&str],
                   values: &[Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyDict>> {
    let keys = keys.get_or_init(py, || names.iter().map(|name| PyString::intern(py, name).unbind()).collect());
    let record = presized(py, values.len() as isize)?;
    for (key, value) in keys.iter().zip(values) {
        record.set_item(key.bind(py), value)?;
    }
    Ok(record)
}

/// The event types compiled here; every other goes to `Fold._apply`.
const COMPILED_TYPES: &[&str] = &["ChildReserved", "ChildActivated", "UsageReported", "ChildCompleted", "ChildSkipped",
                                   "CancelAcknowledged", "ChildFailed", "SpeculativeWinner", "ParentClosed",
                                   "ParentReserved"];

fn holding_term(state: &str) -> Option<&'static str> {
    match state {
        RESERVED | ACTIVATED | PARTIALLY_CONSUMED | CANCEL_REQUESTED => Some("outstanding"),
        EXPIRED | RECONCILING | STRANDED => Some("pending"),
        _ => None,
    }
}

fn is_live(state: &str) -> bool {
    matches!(state, RESERVED | ACTIVATED | PARTIALLY_CONSUMED | CANCEL_REQUESTED)
}

fn is_pending(state: &str) -> bool {
    matches!(state, EXPIRED | RECONCILING | STRANDED)
}

fn is_settled(state: &str) -> bool {
    matches!(state, COMMITTED | RELEASED)
}

/// Why an event did not apply: a result code and its detail (handlers.Reject), `Delegate` (give the event to the
/// Python fold, before anything changed), or a Python error (which stops the partition, as in the Python fold).
enum Fail {
    Reject(&'static str, String),
    Delegate,
    Py(PyErr),
}

impl From<PyErr> for Fail {
    fn from(err: PyErr) -> Self {
        Fail::Py(err)
    }
}

type Step<T> = Result<T, Fail>;

fn reject<T>(code: &'static str, detail: String) -> Step<T> {
    Err(Fail::Reject(code, detail))
}

// -- dict access ----------------------------------------------------------------------------------------------

/// A new dict with room for `size` items, as Python makes for a dict display (no resize while it is filled).
pub(crate) fn presized(py: Python<'_>, size: isize) -> PyResult<Bound<'_, PyDict>> {
    // SAFETY: _PyDict_NewPresized returns a new reference to a dict, or NULL with an exception set.
    unsafe { Ok(Bound::from_owned_ptr_or_err(py, pyo3::ffi::_PyDict_NewPresized(size))?.downcast_into_unchecked()) }
}

/// Every result code the core gives.
const CODES: [&str; 17] = [OK, DUPLICATE, IDEMPOTENCY_CONFLICT, OVERDRAWN, EXCEEDS_AVAILABLE, FANOUT_EXCEEDED,
                           INVALID_TRANSITION, DISPATCH_FENCED, STALE_LEASE_GENERATION, SUPERSEDED_ATTEMPT,
                           UNKNOWN_PARENT, UNKNOWN_CHILD, PARENT_CLOSED_CODE, ALREADY_SETTLED, INVALID_EVENT,
                           DUPLICATE_USAGE_REPORT, LIMIT_EXCEEDED];
static CODE_NAMES: pyo3::sync::GILOnceCell<Vec<Py<PyString>>> = pyo3::sync::GILOnceCell::new();

/// A result code as a Python string, made once per code (every event's result and idempotency record name one).
fn code_name<'py>(py: Python<'py>, code: &str) -> Bound<'py, PyString> {
    let names = CODE_NAMES.get_or_init(py, || CODES.iter().map(|c| PyString::intern(py, c).unbind()).collect());
    match CODES.iter().position(|c| *c == code) {
        Some(n) => names[n].bind(py).clone(),
        None => crate::new_str(py, code),
    }
}

/// A state's name as a Python string: the interned one for the ledger's states (most audit records name two).
fn state_name<'py>(py: Python<'py>, state: &str) -> Bound<'py, PyString> {
    let interned = match state {
        RESERVED => intern!(py, "reserved"),
        ACTIVATED => intern!(py, "activated"),
        PARTIALLY_CONSUMED => intern!(py, "partially_consumed"),
        CANCEL_REQUESTED => intern!(py, "cancel_requested"),
        EXPIRED => intern!(py, "expired"),
        RECONCILING => intern!(py, "reconciling"),
        STRANDED => intern!(py, "stranded"),
        COMMITTED => intern!(py, "committed"),
        RELEASED => intern!(py, "released"),
        PARENT_OPEN => intern!(py, "open"),
        PARENT_CLOSING => intern!(py, "closing"),
        PARENT_CLOSED => intern!(py, "closed"),
        "" => intern!(py, ""),
        _ => return crate::new_str(py, state),
    };
    interned.clone()
}

/// The interned name of a balance term.
fn term_name<'py>(py: Python<'py>, term: &str) -> &'py Bound<'py, PyString> {
    match term {
        "outstanding" => intern!(py, "outstanding"),
        "pending" => intern!(py, "pending"),
        "available" => intern!(py, "available"),
        "returned_to_pool" => intern!(py, "returned_to_pool"),
        _ => unreachable!("not a term the fold moves: {term}"),
    }
}

fn item<'py>(dict: &Bound<'py, PyDict>, key: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
    match dict.get_item(key)? {
        Some(value) => Ok(value),
        None => Err(pyo3::exceptions::PyKeyError::new_err(key.clone().unbind())),
    }
}

fn int<'py>(dict: &Bound<'py, PyDict>, key: &Bound<'py, PyString>) -> PyResult<i64> {
    item(dict, key)?.extract()
}

fn sub_dict<'py>(dict: &Bound<'py, PyDict>, key: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyDict>> {
    Ok(item(dict, key)?.downcast_into::<PyDict>()?)
}

fn text(value: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(value.str()?.to_str()?.to_owned())
}

fn repr(value: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(value.repr()?.to_str()?.to_owned())
}

/// `dict[key] += delta`.
fn add<'py>(dict: &Bound<'py, PyDict>, key: &Bound<'py, PyString>, delta: i64) -> PyResult<()> {
    dict.set_item(key, int(dict, key)? + delta)
}

fn state_of<'py>(child: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyString>> {
    Ok(item(child, intern!(child.py(), "state"))?.downcast_into::<PyString>()?)
}

/// model.remainder: reserved but not consumed, never negative.
fn remainder(child: &Bound<'_, PyDict>, dim: &Bound<'_, PyAny>) -> PyResult<i64> {
    let py = child.py();
    let reserved: i64 = match sub_dict(child, intern!(py, "reserved"))?.get_item(dim)? {
        Some(q) => q.extract()?,
        None => 0,
    };
    let consumed: i64 = match sub_dict(child, intern!(py, "consumed"))?.get_item(dim)? {
        Some(q) => q.extract()?,
        None => 0,
    };
    Ok((reserved - consumed).max(0))
}

// -- quick validation (validation._plainly_valid) ------------------------------------------------------------

fn plain_id(value: &Bound<'_, PyAny>, limit: usize) -> bool {
    if !value.is_exact_instance_of::<PyString>() {
        return false;
    }
    match value.downcast::<PyString>().map(|s| s.to_str()) {
        Ok(Ok(s)) => !s.is_empty() && s.len() <= limit && s.is_ascii() && !s.contains('\0'),
        _ => false,
    }
}

/// The identifier fields validation checks of an event of `etype`, as interned keys (a lookup by a key made anew
/// would create and hash a string each time).
fn id_fields<'py>(py: Python<'py>, etype: &str) -> [&'py Bound<'py, PyString>; 5] {
    let (event_id, parent_id, child_id) = (intern!(py, "event_id"), intern!(py, "parent_id"), intern!(py, "child_id"));
    match etype {
        "ChildReserved" => [event_id, parent_id, child_id, intern!(py, "branch_id"), intern!(py, "attempt_id")],
        "UsageReported" => [event_id, parent_id, child_id, intern!(py, "attempt_id"), intern!(py, "usage_report_id")],
        "SpeculativeWinner" => {
            let winner = intern!(py, "winner_attempt_id");
            [event_id, parent_id, intern!(py, "branch_id"), winner, winner]
        }
        "ParentClosed" | "ParentReserved" => [event_id, parent_id, parent_id, parent_id, parent_id],
        _ => [event_id, parent_id, child_id, intern!(py, "attempt_id"), intern!(py, "attempt_id")],
    }
}

/// True only where `validation.validate` finds nothing; false means: let the Python fold decide.
fn plainly_valid(event: &Bound<'_, PyDict>, etype: &str) -> PyResult<bool> {
    let py = event.py();
    for field in id_fields(py, etype) {
        match event.get_item(field)? {
            Some(value) if plain_id(&value, MAX_ID_BYTES) => {}
            _ => return Ok(false),
        }
    }
    let key = match event.get_item(intern!(py, "idempotency_key"))? {
        Some(key) if plain_id(&key, MAX_KEY_BYTES) => key,
        _ => return Ok(false),
    };
    if key.downcast::<PyString>()?.to_str()?.contains("/loan/") {
        return Ok(false);
    }
    for field in [intern!(py, "quantities"), intern!(py, "usage")] {
        let Some(quantities) = event.get_item(field)? else { continue };
        if !quantities.is_truthy()? {
            continue;
        }
        let Ok(quantities) = quantities.downcast::<PyDict>() else { return Ok(false) };
        if quantities.len() > MAX_DIMENSIONS {
            return Ok(false);
        }
        for (dim, quantity) in quantities.iter() {
            if !plain_id(&dim, MAX_ID_BYTES) || !quantity.is_exact_instance_of::<PyInt>() {
                return Ok(false);
            }
            match quantity.extract::<i64>() {
                Ok(q) if (0..=MAX_QUANTITY).contains(&q) => {}
                _ => return Ok(false),
            }
        }
    }
    if let Some(ttl) = event.get_item(intern!(py, "lease_ttl_ms"))? {
        match ttl.extract::<i64>() {
            Ok(t) if t > 0 && t <= MAX_TTL_MS => {}
            _ => return Ok(false),
        }
    }
    if let Some(generation) = event.get_item(intern!(py, "lease_generation"))? {
        match generation.extract::<i64>() {
            Ok(g) if (0..=MAX_LEASE_GENERATION).contains(&g) => {}
            _ => return Ok(false),
        }
    }
    if etype == "ChildReserved" {
        return match event.get_item(intern!(py, "quantities"))? {
            Some(q) => q.is_truthy(),
            None => Ok(false),
        };
    }
    if etype == "ParentReserved" {
        return parent_reservation_valid(event);
    }
    if etype == "ParentClosed" {
        return Ok(matches!(event.get_item(intern!(py, "outcome"))?,
                           Some(outcome) if outcome.is_exact_instance_of::<PyString>()
                                            && PARENT_OUTCOMES.contains(&outcome.downcast::<PyString>()?.to_str()?)));
    }
    if etype == "ChildSkipped" {
        // its note is its reason; it names no usage (handlers.child_skipped checks no dimensions)
        return Ok(event.get_item(intern!(py, "usage"))?.is_none()
                  && matches!(event.get_item(intern!(py, "reason"))?, Some(r) if r.is_exact_instance_of::<PyString>()));
    }
    if etype == "CancelAcknowledged" || etype == "ChildFailed" {
        return known_outcome(event, etype);
    }
    Ok(true)
}

/// A plain quantity: an int from 0 to MAX_QUANTITY.
fn plain_quantity(value: &Bound<'_, PyAny>) -> bool {
    value.is_exact_instance_of::<PyInt>() && matches!(value.extract::<i64>(), Ok(q) if (0..=MAX_QUANTITY).contains(&q))
}

/// An int within `range`.
fn int_within(value: Option<Bound<'_, PyAny>>, range: std::ops::RangeInclusive<i64>) -> bool {
    matches!(value, Some(v) if v.is_exact_instance_of::<PyInt>()
                               && matches!(v.extract::<i64>(), Ok(n) if range.contains(&n)))
}

/// validation._validate_parent_reserved finds nothing, every name of a dimension a plain id (its ids, key and lease
/// were checked by plainly_valid).
fn parent_reservation_valid(event: &Bound<'_, PyDict>) -> PyResult<bool> {
    let py = event.py();
    let Some(capacity) = event.get_item(intern!(py, "capacity"))? else { return Ok(false) };
    let Ok(capacity) = capacity.downcast_exact::<PyDict>() else { return Ok(false) };
    if capacity.is_empty() || capacity.len() > MAX_DIMENSIONS {
        return Ok(false);
    }
    for (dim, spec) in capacity.iter() {
        let Ok(spec) = spec.downcast_exact::<PyDict>() else { return Ok(false) };
        let kind_known = matches!(spec.get_item(intern!(py, "kind"))?,
                                  Some(kind) if kind.is_exact_instance_of::<PyString>()
                                                && DIMENSION_KINDS.contains(&kind.downcast::<PyString>()?.to_str()?));
        if !plain_id(&dim, MAX_ID_BYTES) || !kind_known
            || !matches!(spec.get_item(intern!(py, "quantity"))?, Some(q) if plain_quantity(&q)) {
            return Ok(false);
        }
    }
    let Some(policy) = event.get_item(intern!(py, "policy"))? else { return Ok(false) };
    let Ok(policy) = policy.downcast_exact::<PyDict>() else { return Ok(false) };
    if !int_within(policy.get_item(intern!(py, "max_live_children"))?, 1..=MAX_CHILDREN_PER_PARENT as i64)
        || !int_within(policy.get_item(intern!(py, "reconciliation_timeout_ms"))?, 1..=MAX_TTL_MS)
        || !int_within(event.get_item(intern!(py, "lease_ttl_ms"))?, 1..=MAX_TTL_MS) {
        return Ok(false);
    }
    let Some(lending) = policy.get_item(intern!(py, "lending_limit"))? else { return Ok(false) };
    let Ok(lending) = lending.downcast_exact::<PyDict>() else { return Ok(false) };
    if lending.len() > MAX_DIMENSIONS {
        return Ok(false);
    }
    for (dim, quantity) in lending.iter() {
        if !plain_id(&dim, MAX_ID_BYTES) || !plain_quantity(&quantity) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// validation._outcome_problem finds nothing, and the outcome is one the core settles itself: the usage known (a
/// total, `usage_uncertain` false), a retry that is a plain id of another attempt or none. An uncertain usage, or
/// a failure that names no usage (before activation, or so the executor says), goes to the Python fold: it may
/// enter reconciliation (handlers._settle_outcome, child_failed).
fn known_outcome(event: &Bound<'_, PyDict>, etype: &str) -> PyResult<bool> {
    let py = event.py();
    match event.get_item(intern!(py, "usage_uncertain"))? {
        Some(uncertain) if uncertain.is_exact_instance_of::<PyBool>() && !uncertain.is_truthy()? => {}
        _ => return Ok(false),
    }
    if !matches!(event.get_item(intern!(py, "usage"))?, Some(usage) if usage.is_exact_instance_of::<PyDict>()) {
        return Ok(false);
    }
    if event.get_item(intern!(py, "lease_generation"))?.is_none() {
        return Ok(false);
    }
    if etype == "ChildFailed" {
        match event.get_item(intern!(py, "activated"))? {
            Some(activated) if activated.is_exact_instance_of::<PyBool>() => {}
            _ => return Ok(false),
        }
        if !matches!(event.get_item(intern!(py, "reason"))?, Some(r) if r.is_exact_instance_of::<PyString>()) {
            return Ok(false);
        }
    }
    match event.get_item(intern!(py, "retry_attempt_id"))? {
        None => Ok(true),
        Some(retry) if retry.is_none() => Ok(true),
        Some(retry) => {
            if !retry.is_exact_instance_of::<PyString>() {
                return Ok(false);
            }
            if retry.downcast::<PyString>()?.to_str()?.is_empty() {
                return Ok(true); // empty: no retry keeps the capacity
            }
            let attempt = event.get_item(intern!(py, "attempt_id"))?;
            Ok(plain_id(&retry, MAX_ID_BYTES) && !matches!(attempt, Some(a) if a.eq(&retry)?))
        }
    }
}

/// Kafka's murmur2 (schemas/partitioning.py), bit for bit.
pub fn murmur2(data: &[u8]) -> u32 {
    const SEED: u32 = 0x9747_B28C;
    const M: u32 = 0x5BD1_E995;
    let length = data.len();
    let mut h = SEED ^ (length as u32);
    let end = length & !3;
    for i in (0..end).step_by(4) {
        let mut k = u32::from_le_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]).wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let tail = length & 3;
    if tail == 3 {
        h ^= (data[end + 2] as u32) << 16;
    }
    if tail >= 2 {
        h ^= (data[end + 1] as u32) << 8;
    }
    if tail >= 1 {
        h ^= data[end] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// The compiled writer of `name`'s records among `fold._change_writers` (set once the fold is made), if any, with
/// where it finds the values of `slots`; looked up once, into `cell`.
#[allow(clippy::type_complexity)]
fn change_writer<'py>(cell: &pyo3::sync::GILOnceCell<Option<(Py<crate::Encoder>, Option<crate::SlotOrder>)>>,
                      fold: &Bound<'py, PyAny>, name: &str, slots: &[&str])
                      -> PyResult<Option<(Bound<'py, crate::Encoder>, Option<crate::SlotOrder>)>> {
    let py = fold.py();
    let writer = cell.get_or_try_init(py, || -> PyResult<_> {
        let writers = fold.getattr(intern!(py, "_change_writers"))?;
        if writers.is_none() {
            return Ok(None);
        }
        let found = writers.get_item(0)?.downcast_into::<PyDict>()?.get_item(name)?;
        Ok(found.and_then(|w| w.downcast_into::<crate::Encoder>().ok()).map(|w| {
            let order = w.get().slot_order(py, slots);
            (w.unbind(), order)
        }))
    })?;
    Ok(writer.as_ref().map(|(w, order)| (w.bind(py).clone(), *order)))
}

// -- the event being applied (context.EventContext) ----------------------------------------------------------

struct Ctx<'py> {
    py: Python<'py>,
    view: Bound<'py, PyAny>,
    cache: Bound<'py, PyDict>,
    dirty: Bound<'py, PyDict>,
    sizes: Bound<'py, PyDict>,
    store: Bound<'py, PyAny>,
    decode: Bound<'py, PyAny>,
    decoded_size: Bound<'py, PyAny>,
    // The codec's compiled writer of idempotency records, where the view encodes with a compiled codec, and where
    // it finds IDEMPOTENCY_SLOTS' values.
    idempotency_writer: Option<(Bound<'py, crate::Encoder>, Option<crate::SlotOrder>)>,
    // The same for timer records (TIMER_SLOTS).
    timer_writer: Option<(Bound<'py, crate::Encoder>, Option<crate::SlotOrder>)>,
    event: Bound<'py, PyDict>,
    etype: Bound<'py, PyAny>,
    event_id: Bound<'py, PyAny>,
    key: Bound<'py, PyAny>,
    partition: Bound<'py, PyAny>,
    offset: Bound<'py, PyAny>,
    now_ms: i64,
    audits: Bound<'py, PyList>,
    releases: Bound<'py, PyList>,
    settled: Bound<'py, PyList>,
    touched: Vec<(Bound<'py, PyAny>, Bound<'py, PyDict>)>,
    touched_children: Vec<Bound<'py, PyDict>>,
    overdrawn: bool,
    /// What the event changed in the view's `cached_bytes` so far, added to it once (Ctx::settle_charges).
    charged: std::cell::Cell<i64>,
    /// Where the event's audit records are written at once (FoldCore::apply_with), instead of into `audits` as dicts.
    direct: Option<DirectAudits<'py>>,
    /// The record keys this event made, each made once: a record read and written again uses the same object.
    keys: std::cell::RefCell<Vec<(Vec<u8>, Bound<'py, PyBytes>)>>,
    /// The event's idempotency key where it is in neither the cache nor the store: not cached as absent unless
    /// the event ends without writing it (Ctx::cache_absent_key).
    absent_key: std::cell::RefCell<Option<Bound<'py, PyBytes>>>,
}

/// An event's audit records, encoded as they are made: (key, value), as OutputEncoder would give them; and its
/// releases too where `release` is (the releases' route is the second, Direct::releases).
struct DirectAudits<'py> {
    writer: Bound<'py, crate::Encoder>,
    order: crate::SlotOrder,
    name: Bound<'py, PyString>,
    encode: Bound<'py, PyAny>,
    written: std::cell::RefCell<(Vec<Written<'py>>, Vec<u8>)>,
    release: Option<(Bound<'py, crate::Encoder>, crate::SlotOrder, Bound<'py, PyString>)>,
    releases: std::cell::RefCell<Vec<Release<'py>>>,
}

/// A release written: the record (key, value), and its dimension, destination and quantity (OutputEncoder's totals).
pub(crate) struct Release<'py> {
    pub(crate) record: Written<'py>,
    pub(crate) dimension: Bound<'py, PyAny>,
    pub(crate) destination: Bound<'py, PyString>,
    pub(crate) quantity: Bound<'py, PyAny>,
}

/// A record written: (key, value).
type Written<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>);

/// What FoldCore::apply_with gives `settle run`'s loop.
pub(crate) enum Applied<'py> {
    /// The Python fold took the event: its result, and its outputs in `out` (as Fold.apply).
    Dict(Bound<'py, PyAny>),
    /// The core took it: the result code, the result record, the releases (where Direct::releases is) and the audit
    /// records written (key, value), the other outputs in `out`.
    Direct {
        code: Bound<'py, PyString>,
        result: Written<'py>,
        releases: Vec<Release<'py>>,
        audits: Vec<Written<'py>>,
    },
}


impl<'py> Ctx<'py> {
    fn field(&self, name: &Bound<'py, PyString>) -> PyResult<Bound<'py, PyAny>> {
        item(&self.event, name)
    }

    /// context.EventContext.audit
    #[allow(clippy::too_many_arguments)]
    fn audit(&self, parent_id: &Bound<'py, PyAny>, child: Option<&Bound<'py, PyDict>>, prior_state: &str,
             new_state: &str, note: &str, dimension: Option<&Bound<'py, PyAny>>, quantity: Option<i64>)
             -> PyResult<()> {
        let py = self.py;
        let (child_id, attempt_id, generation) = match child {
            Some(child) => (item(child, intern!(py, "child_id"))?, item(child, intern!(py, "attempt_id"))?,
                            item(child, intern!(py, "lease_generation"))?),
            None => (intern!(py, "").clone().into_any(), intern!(py, "").clone().into_any(),
                     0i64.into_pyobject(py)?.into_any()),
        };
        let none = || py.None().into_bound(py);
        // in AUDIT_SLOTS' order
        let values = [parent_id.clone(), child_id, attempt_id, dimension.cloned().unwrap_or_else(none),
                      match quantity { Some(q) => q.into_pyobject(py)?.into_any(), None => none() },
                      state_name(py, prior_state).into_any(), state_name(py, new_state).into_any(),
                      self.key.clone(), generation, self.event_id.clone(), self.etype.clone(),
                      self.partition.clone(), self.offset.clone(), self.now_ms.into_pyobject(py)?.into_any(),
                      crate::new_str(py, note).into_any()];
        let Some(direct) = &self.direct else {
            return self.audits.append(slots_dict(py, &AUDIT_KEYS, &AUDIT_SLOTS, &values)?);
        };
        let mut written = direct.written.borrow_mut();
        let (records, buffer) = &mut *written;
        let value = match direct.writer.get().encode_slots(py, &direct.order, &values, buffer) {
            Ok(bytes) => bytes.into_any(),
            Err(crate::NotPlain) => {
                direct.encode.call1((&direct.name, slots_dict(py, &AUDIT_KEYS, &AUDIT_SLOTS, &values)?))?
            }
        };
        records.push((output_key(parent_id)?, value));
        Ok(())
    }

    /// context.EventContext.release
    fn release(&self, parent: &Bound<'py, PyDict>, child: Option<&Bound<'py, PyDict>>, dimension: &Bound<'py, PyAny>,
               quantity: i64, destination: &str, reason: &str) -> PyResult<()> {
        let py = self.py;
        let parent_id = item(parent, intern!(py, "parent_id"))?;
        let (child_id, attempt_id) = match child {
            Some(child) => (item(child, intern!(py, "child_id"))?, item(child, intern!(py, "attempt_id"))?),
            None => (intern!(py, "").clone().into_any(), intern!(py, "").clone().into_any()),
        };
        let key = release_key(&parent_id, &self.key, &child_id, dimension, destination)?;
        let balance = sub_dict(&sub_dict(parent, intern!(py, "dimensions"))?, dimension.downcast()?)?;
        let written = self.direct.as_ref().and_then(|direct| Some((direct, direct.release.as_ref()?)));
        // Encoded now, the parent's balance as it is now; a record kept till the encoder's turn keeps a copy.
        let balance = if written.is_some() { balance } else { balance.copy()? };
        let (destination, quantity) = (crate::new_str(py, destination), quantity.into_pyobject(py)?.into_any());
        // in RELEASE_SLOTS' order
        let values = [crate::new_str(py, &key).into_any(), parent_id.clone(), child_id, attempt_id, dimension.clone(),
                      quantity.clone(), destination.clone().into_any(), crate::new_str(py, reason).into_any(),
                      self.key.clone(), self.event_id.clone(), balance.into_any(), self.partition.clone(),
                      self.offset.clone(), self.now_ms.into_pyobject(py)?.into_any()];
        let Some((direct, (writer, order, name))) = written else {
            return self.releases.append(slots_dict(py, &RELEASE_KEYS, &RELEASE_SLOTS, &values)?);
        };
        let mut buffer = Vec::with_capacity(256);
        let value = match writer.get().encode_slots(py, order, &values, &mut buffer) {
            Ok(bytes) => bytes.into_any(),
            Err(crate::NotPlain) => {
                direct.encode.call1((name, slots_dict(py, &RELEASE_KEYS, &RELEASE_SLOTS, &values)?))?
            }
        };
        direct.releases.borrow_mut().push(Release {
            record: (output_key(&parent_id)?, value), dimension: dimension.clone(), destination, quantity,
        });
        Ok(())
    }

    // -- the view ---------------------------------------------------------------------------------------------

    /// The key object of `key`: the one this event made already, or a new one.
    fn key_object(&self, key: Vec<u8>) -> Bound<'py, PyBytes> {
        let mut keys = self.keys.borrow_mut();
        if let Some((_, object)) = keys.iter().find(|(bytes, _)| *bytes == key) {
            return object.clone();
        }
        let object = PyBytes::new(self.py, &key);
        if keys.len() < KEYS_KEPT {
            keys.push((key, object.clone()));
        }
        object
    }

    /// LedgerView._get
    fn get(&self, key: Vec<u8>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.lookup(self.key_object(key), true)
    }

    /// LedgerView._get, where `cache_absent` says whether a key found nowhere is cached as absent (as `_get` does)
    /// or, for the event's idempotency key, left to Ctx::cache_absent_key.
    fn lookup(&self, key: Bound<'py, PyBytes>, cache_absent: bool) -> PyResult<Option<Bound<'py, PyDict>>> {
        let py = self.py;
        let found = match self.cache.get_item(&key)? {
            Some(found) => found,
            None => {
                let entry = self.dirty.get_item(&key)?;
                let raw = match &entry {
                    None => self.store.call_method1(intern!(py, "get"), (&key,))?,
                    Some(entry) if entry.is_none() => py.None().into_bound(py),
                    Some(entry) => entry.get_item(1)?,
                };
                if raw.is_none() {
                    if cache_absent {
                        self.cache.set_item(&key, py.None())?;
                        self.charge(&key, ENTRY_BYTES)?;
                    } else {
                        *self.absent_key.borrow_mut() = Some(key);
                    }
                    return Ok(None);
                }
                let decoded = self.decode.call1((&raw,))?;
                let (name, record) = (decoded.get_item(0)?, decoded.get_item(1)?);
                self.cache.set_item(&key, &record)?;
                let size: i64 = self.decoded_size.call1((&key, raw.len()?))?.extract()?;
                self.charge(&key, size)?;
                if !record.is_none() && entry.is_some() {
                    self.dirty.set_item(&key, (name, &record))?; // spilled earlier: the record is the change again
                }
                record
            }
        };
        Ok(if found.is_none() { None } else { Some(found.downcast_into()?) })
    }

    /// LedgerView._charge, the view's `cached_bytes` written once the event is through (Ctx::settle_charges)
    fn charge(&self, key: &Bound<'py, PyBytes>, size: i64) -> PyResult<()> {
        let before: i64 = match self.sizes.get_item(key)? {
            Some(before) => before.extract()?,
            None => 0,
        };
        self.charged.set(self.charged.get() + size - before);
        self.sizes.set_item(key, size)
    }

    /// The view's `cached_bytes` with this event's charges added (once per event, not per record): its value now.
    fn settle_charges(&self) -> PyResult<i64> {
        let py = self.py;
        let cached: i64 = self.view.getattr(intern!(py, "cached_bytes"))?.extract()?;
        let charged = self.charged.replace(0);
        if charged != 0 {
            self.view.setattr(intern!(py, "cached_bytes"), cached + charged)?;
        }
        Ok(cached + charged)
    }

    /// The event's idempotency key, looked up and found nowhere, is cached as absent only now that the event
    /// ended without writing it (a rejection): the view's cache and its size are then as `_get` leaves them,
    /// without caching and uncaching the key of every event that is taken.
    fn cache_absent_key(&self) -> PyResult<()> {
        if let Some(key) = self.absent_key.borrow_mut().take() {
            if !self.cache.contains(&key)? {
                self.cache.set_item(&key, self.py.None())?;
                self.charge(&key, ENTRY_BYTES)?;
            }
        }
        Ok(())
    }

    /// LedgerView._put
    fn put(&self, key: Vec<u8>, name: &Bound<'py, PyString>, record: &Bound<'py, PyDict>) -> PyResult<()> {
        let key = self.key_object(key);
        let cached = self.cache.get_item(&key)?;
        if !cached.is_some_and(|cached| cached.is(record)) {
            self.cache.set_item(&key, record)?;
            self.charge(&key, NEW_RECORD_BYTES)?;
        }
        self.dirty.set_item(key, (name, record))
    }

    fn parent(&self, parent_id: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.get(record_key(KEY_PARENT, &[parent_id])?)
    }

    fn child(&self, parent_id: &Bound<'py, PyAny>, child_id: &Bound<'py, PyAny>)
             -> PyResult<Option<Bound<'py, PyDict>>> {
        self.get(record_key(KEY_CHILD, &[parent_id, child_id])?)
    }

    fn idempotency(&self, parent_id: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.lookup(self.key_object(record_key(KEY_IDEMPOTENCY, &[parent_id, &self.key])?), false)
    }

    /// LedgerView.put_idempotency: encoded at once into the changes, and out of the cache. `values`: the record's, in
    /// IDEMPOTENCY_SLOTS' order (a dict of them only where the compiled writer cannot write them from there).
    fn put_idempotency(&self, parent_id: &Bound<'py, PyAny>, values: &[Bound<'py, PyAny>; 4]) -> PyResult<()> {
        let py = self.py;
        let key = self.key_object(record_key(KEY_IDEMPOTENCY, &[parent_id, &self.key])?);
        let absent = self.absent_key.borrow_mut().take();
        if !absent.is_some_and(|absent| absent.is(&key)) && self.cache.contains(&key)? {
            // looked up first, and cached as absent
            self.cache.del_item(&key)?;
            if let Some(size) = self.sizes.get_item(&key)? {
                let size: i64 = size.extract()?;
                self.sizes.del_item(&key)?;
                self.charged.set(self.charged.get() - size);
            }
        }
        let name = intern!(py, IDEMPOTENCY_RECORD);
        let mut buffer = Vec::with_capacity(128);
        let compiled = self.idempotency_writer.as_ref().and_then(|(writer, order)| {
            let writer = writer.get();
            match order {
                Some(order) => writer.encode_slots(py, order, values, &mut buffer).ok(),
                None => writer.encode_with(py, idempotency_dict(py, values).ok()?.as_any(), &mut buffer).ok(),
            }
        });
        let encoded = match compiled {
            Some(bytes) => bytes.into_any(),
            None => self.view.getattr(intern!(py, "_encode"))?.call1((name, idempotency_dict(py, values)?))?,
        };
        self.dirty.set_item(key, (name, encoded))
    }

    /// LedgerView.add_timer: onto the view's heap, and its record into the changes, encoded at once. Ids that are
    /// not exactly strings go to the view's own.
    fn add_timer(&self, deadline_ms: i64, kind: &str, parent_id: &Bound<'py, PyAny>,
                 child_id: Option<&Bound<'py, PyAny>>) -> PyResult<()> {
        let py = self.py;
        let child_id = match child_id {
            Some(child_id) => child_id.clone(),
            None => intern!(py, "").clone().into_any(),
        };
        let (Ok(parent), Ok(child)) = (parent_id.downcast_exact::<PyString>(), child_id.downcast_exact::<PyString>())
        else {
            self.view.call_method1(intern!(py, "add_timer"), (deadline_ms, kind, parent_id, &child_id))?;
            return Ok(());
        };
        let kind = match kind {
            TIMER_CHILD_LEASE => intern!(py, "child_lease").clone(),
            TIMER_PARENT_RETENTION => intern!(py, "parent_retention").clone(),
            _ => crate::new_str(py, kind),
        };
        let deadline = deadline_ms.into_pyobject(py)?;
        let timer = pyo3::types::PyTuple::new(py, [deadline.as_any(), kind.as_any(), parent.as_any(), child.as_any()])?;
        let heappush = HEAPPUSH.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            Ok(py.import("heapq")?.getattr("heappush")?.unbind())
        })?;
        heappush.bind(py).call1((self.view.getattr(intern!(py, "_timers"))?, &timer))?;
        let key = format!("{KEY_TIMER}{KEY_SEP}{deadline_ms:0width$}{KEY_SEP}{}{KEY_SEP}{}{KEY_SEP}{}", kind.to_str()?,
                          parent.to_str()?, child.to_str()?, width = DEADLINE_DIGITS);
        let name = intern!(py, TIMER_RECORD);
        // in TIMER_SLOTS' order
        let values = [kind.into_any(), deadline.into_any(), parent.clone().into_any(), child.clone().into_any()];
        let mut buffer = Vec::with_capacity(96);
        let compiled = self.timer_writer.as_ref().and_then(|(writer, order)| {
            writer.get().encode_slots(py, order.as_ref()?, &values, &mut buffer).ok()
        });
        let encoded = match compiled {
            Some(bytes) => bytes.into_any(),
            None => self.view.getattr(intern!(py, "_encode"))?.call1((name, timer_dict(py, &values)?))?,
        };
        self.dirty.set_item(PyBytes::new(py, key.as_bytes()), (name, encoded))
    }

    /// accounting.touch
    fn touch(&mut self, parent: &Bound<'py, PyDict>, child: Option<&Bound<'py, PyDict>>) -> PyResult<()> {
        let py = self.py;
        let parent_id = item(parent, intern!(py, "parent_id"))?;
        let mut found = None;
        for (index, (id, _)) in self.touched.iter().enumerate() {
            if id.eq(&parent_id)? {
                found = Some(index);
                break;
            }
        }
        let put = match found {
            Some(index) if self.touched[index].1.is(parent) => false,
            Some(index) => {
                self.touched[index].1 = parent.clone();
                true
            }
            None => {
                self.touched.push((parent_id.clone(), parent.clone()));
                true
            }
        };
        if put {
            self.put(record_key(KEY_PARENT, &[&parent_id])?, intern!(py, PARENT_RECORD), parent)?;
        }
        if let Some(child) = child {
            if !self.touched_children.iter().any(|c| c.is(child)) {
                self.touched_children.push(child.clone());
                let key = record_key(KEY_CHILD, &[&item(child, intern!(py, "parent_id"))?,
                                                  &item(child, intern!(py, "child_id"))?])?;
                self.put(key, intern!(py, CHILD_RECORD), child)?;
            }
        }
        Ok(())
    }
}

/// keys.parent_key, child_key, idempotency_key: the kind's letter, then each part after a NUL.
fn record_key(kind: &str, parts: &[&Bound<'_, PyAny>]) -> PyResult<Vec<u8>> {
    let mut key = Vec::with_capacity(64);
    key.extend_from_slice(kind.as_bytes());
    for part in parts {
        key.extend_from_slice(KEY_SEP.as_bytes());
        key.extend_from_slice(part.downcast::<PyString>()?.to_str()?.as_bytes());
    }
    Ok(key)
}

fn key_part(value: &str) -> String {
    let part = value.replace('%', "%25").replace('/', "%2F");
    if part == "-" { "%2D".to_owned() } else { part }
}

/// context.release_key
fn release_key(parent_id: &Bound<'_, PyAny>, key: &Bound<'_, PyAny>, child_id: &Bound<'_, PyAny>,
               dimension: &Bound<'_, PyAny>, destination: &str) -> PyResult<String> {
    let child_id = child_id.downcast::<PyString>()?.to_str()?;
    let child = if child_id.is_empty() { "-".to_owned() } else { key_part(child_id) };
    Ok(format!("{}/{}/{}/{}/{}", key_part(parent_id.downcast::<PyString>()?.to_str()?),
               key.downcast::<PyString>()?.to_str()?, child,
               key_part(dimension.downcast::<PyString>()?.to_str()?), destination))
}

// -- accounting.py ----------------------------------------------------------------------------------------------

/// accounting.set_state
fn set_state<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>, new_state: &str,
                  note: &str) -> PyResult<()> {
    let py = ctx.py;
    let old_state = state_of(child)?;
    let old_state = old_state.to_str()?;
    let old_term = holding_term(old_state);
    let new_term = holding_term(new_state);
    if let (Some(old_term), Some(new_term)) = (old_term, new_term) {
        if old_term != new_term {
            let dims = sub_dict(parent, intern!(py, "dimensions"))?;
            for dim in sub_dict(child, intern!(py, "reserved"))?.keys() {
                let quantity = remainder(child, &dim)?;
                if quantity != 0 {
                    let balance = sub_dict(&dims, dim.downcast()?)?;
                    add(&balance, term_name(py, old_term), -quantity)?;
                    add(&balance, term_name(py, new_term), quantity)?;
                }
            }
        }
    }
    let (was_live, now_live) = (is_live(old_state), is_live(new_state));
    if was_live && !now_live {
        add(parent, intern!(py, "live_children"), -1)?;
    } else if now_live && !was_live {
        add(parent, intern!(py, "live_children"), 1)?;
    }
    if is_settled(new_state) && !is_settled(old_state) {
        add(parent, intern!(py, "open_children"), -1)?;
    }
    child.set_item(intern!(py, "state"), state_name(py, new_state))?;
    let parent_id = item(parent, intern!(py, "parent_id"))?;
    ctx.audit(&parent_id, Some(child), old_state, new_state, note, None, None)?;
    ctx.touch(parent, Some(child))
}

/// accounting.draw_overrun
fn draw_overrun(ctx: &mut Ctx<'_>, balance: &Bound<'_, PyDict>, excess: i64) -> PyResult<String> {
    let py = ctx.py;
    let available = int(balance, intern!(py, "available"))?;
    let drawn = excess.min(available);
    balance.set_item(intern!(py, "available"), available - drawn)?;
    add(balance, intern!(py, "overdrawn"), excess - drawn)?;
    if excess - drawn != 0 {
        ctx.overdrawn = true;
        return Ok(format!("overrun of {excess}: {drawn} drawn from available, {} overdrawn", excess - drawn));
    }
    Ok(format!("overrun of {excess} drawn from available"))
}

fn sorted_keys<'py>(dict: &Bound<'py, PyDict>) -> PyResult<Vec<(String, Bound<'py, PyAny>)>> {
    let mut keys = Vec::with_capacity(dict.len());
    for key in dict.keys() {
        keys.push((key.downcast::<PyString>()?.to_str()?.to_owned(), key));
    }
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(keys)
}

/// accounting.commit_usage
fn commit_usage<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>,
                     delta: &Bound<'py, PyDict>) -> PyResult<()> {
    let py = ctx.py;
    let state = state_of(child)?;
    let state = state.to_str()?; // unchanged by the loop below (the child's state moves only in set_state)
    let term = holding_term(state);
    let dims = sub_dict(parent, intern!(py, "dimensions"))?;
    let consumed = sub_dict(child, intern!(py, "consumed"))?;
    let parent_id = item(parent, intern!(py, "parent_id"))?;
    for (_, dim) in sorted_keys(delta)? {
        let quantity: i64 = delta.get_item(&dim)?.expect("a key of the dict").extract()?;
        if quantity <= 0 {
            continue;
        }
        let balance = sub_dict(&dims, dim.downcast()?)?;
        let within = match term {
            Some(_) => quantity.min(remainder(child, &dim)?),
            None => 0,
        };
        let excess = quantity - within;
        if within != 0 {
            add(&balance, term_name(py, term.expect("within is 0 without a term")), -within)?;
        }
        add(&balance, intern!(py, "committed"), quantity)?;
        let note = if excess != 0 { draw_overrun(ctx, &balance, excess)? } else { "usage committed".to_owned() };
        let already: i64 = match consumed.get_item(&dim)? {
            Some(q) => q.extract()?,
            None => 0,
        };
        consumed.set_item(&dim, already + quantity)?;
        ctx.audit(&parent_id, Some(child), state, state, &note, Some(&dim), Some(quantity))?;
    }
    ctx.touch(parent, Some(child))
}

/// accounting.destination: (where, the term it goes to)
fn destination(parent: &Bound<'_, PyDict>) -> PyResult<(&'static str, &'static str)> {
    let status = item(parent, intern!(parent.py(), "status"))?;
    Ok(if status.downcast::<PyString>()?.to_str()? == PARENT_OPEN {
        (DESTINATION_PARENT, "available")
    } else {
        (DESTINATION_POOL, "returned_to_pool")
    })
}

/// accounting.release_remainder
fn release_remainder<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>,
                          reason: &str) -> PyResult<bool> {
    let py = ctx.py;
    let state = state_of(child)?;
    let state = state.to_str()?;
    let term = holding_term(state);
    let dims = sub_dict(parent, intern!(py, "dimensions"))?;
    let parent_id = item(parent, intern!(py, "parent_id"))?;
    let mut returned = false;
    for dim in sub_dict(child, intern!(py, "reserved"))?.keys() {
        let quantity = remainder(child, &dim)?;
        if quantity <= 0 {
            continue;
        }
        returned = true;
        let balance = sub_dict(&dims, dim.downcast()?)?;
        let Some(term) = term else {
            return Err(pyo3::exceptions::PyKeyError::new_err(py.None()));
        };
        add(&balance, term_name(py, term), -quantity)?;
        let kind = item(&balance, intern!(py, "kind"))?;
        if kind.downcast::<PyString>()?.to_str()? == PHYSICAL {
            add(&balance, intern!(py, "awaiting_confirmation"), quantity)?;
            sub_dict(child, intern!(py, "awaiting"))?.set_item(&dim, quantity)?;
            ctx.audit(&parent_id, Some(child), state, state, &format!("{reason}: awaiting scheduler confirmation"),
                      Some(&dim), Some(quantity))?;
            continue;
        }
        let (where_to, target) = destination(parent)?;
        add(&balance, term_name(py, target), quantity)?;
        ctx.release(parent, Some(child), &dim, quantity, where_to, reason)?;
    }
    ctx.touch(parent, Some(child))?;
    Ok(returned)
}

/// accounting.usage_delta
fn usage_delta<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>,
                    total: &Bound<'py, PyDict>) -> PyResult<Bound<'py, PyDict>> {
    let py = ctx.py;
    let delta = PyDict::new(py);
    let consumed = sub_dict(child, intern!(py, "consumed"))?;
    let parent_id = item(parent, intern!(py, "parent_id"))?;
    for (dim, quantity) in total.iter() {
        let quantity: i64 = quantity.extract()?;
        let already: i64 = match consumed.get_item(&dim)? {
            Some(q) => q.extract()?,
            None => 0,
        };
        if quantity < already {
            let state = state_of(child)?;
            let state = state.to_str()?;
            ctx.audit(&parent_id, Some(child), state, state,
                      &format!("reported total {quantity} is below committed usage {already}: committed usage is \
                                never reversed"), Some(&dim), Some(quantity))?;
        }
        delta.set_item(&dim, quantity - already)?;
    }
    Ok(delta)
}

/// accounting.settle
fn settle<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>,
               total: Option<&Bound<'py, PyDict>>, reason: &str, note: &str) -> PyResult<()> {
    if let Some(total) = total {
        if !total.is_empty() {
            let delta = usage_delta(ctx, parent, child, total)?;
            commit_usage(ctx, parent, child, &delta)?;
        }
    }
    let returned = release_remainder(ctx, parent, child, reason)?;
    let new_state = if returned { RELEASED } else { COMMITTED };
    if note.is_empty() {
        set_state(ctx, parent, child, new_state, reason)?;
    } else {
        set_state(ctx, parent, child, new_state, &format!("{reason}: {note}"))?;
    }
    finish_parent_if_done(ctx, parent)
}

/// accounting.hand_to_retry
fn hand_to_retry<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>,
                      total: &Bound<'py, PyDict>, retry_attempt_id: &Bound<'py, PyAny>) -> PyResult<()> {
    let py = ctx.py;
    let delta = usage_delta(ctx, parent, child, total)?;
    commit_usage(ctx, parent, child, &delta)?;
    let old_attempt = text(&item(child, intern!(py, "attempt_id"))?)?;
    let earlier = sub_dict(child, intern!(py, "earlier_attempts_consumed"))?;
    for (dim, quantity) in sub_dict(child, intern!(py, "consumed"))?.iter() {
        let quantity: i64 = quantity.extract()?;
        if quantity != 0 {
            let before: i64 = match earlier.get_item(&dim)? {
                Some(q) => q.extract()?,
                None => 0,
            };
            earlier.set_item(&dim, before + quantity)?;
        }
    }
    let sorted = PyDict::new(py);
    for (_, dim) in sorted_keys(&earlier)? {
        sorted.set_item(&dim, earlier.get_item(&dim)?.expect("a key of the dict"))?;
    }
    child.set_item(intern!(py, "earlier_attempts_consumed"), sorted)?;
    let reserved = PyDict::new(py);
    let consumed = PyDict::new(py);
    for dim in sub_dict(child, intern!(py, "reserved"))?.keys() {
        reserved.set_item(&dim, remainder(child, &dim)?)?;
        consumed.set_item(&dim, 0)?;
    }
    child.set_item(intern!(py, "reserved"), reserved)?;
    child.set_item(intern!(py, "consumed"), consumed)?;
    child.set_item(intern!(py, "attempt_id"), retry_attempt_id)?;
    add(child, intern!(py, "lease_generation"), 1)?;
    child.set_item(intern!(py, "activated"), false)?;
    child.set_item(intern!(py, "lease_expires_at_ms"), py.None())?;
    child.set_item(intern!(py, "reconcile_deadline_ms"), py.None())?;
    child.set_item(intern!(py, "usage_report_ids"), PyList::empty(py))?;
    set_state(ctx, parent, child, RESERVED, &format!("remainder handed from attempt {old_attempt} to retry"))
}

/// accounting.finish_parent_if_done
fn finish_parent_if_done<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>) -> PyResult<()> {
    let py = ctx.py;
    let prior = item(parent, intern!(py, "status"))?.downcast_into::<PyString>()?.to_str()?.to_owned();
    if (prior != PARENT_CLOSING && prior != PARENT_EXPIRED) || int(parent, intern!(py, "open_children"))? != 0 {
        return Ok(());
    }
    for loan in item(parent, intern!(py, "loans"))?.try_iter()? {
        let loan = loan?.downcast_into::<PyDict>()?;
        if item(&loan, intern!(py, "state"))?.downcast::<PyString>()?.to_str()? == LOAN_OPEN {
            return Ok(());
        }
    }
    let dims = sub_dict(parent, intern!(py, "dimensions"))?;
    for balance in dims.values() {
        let balance = balance.downcast_into::<PyDict>()?;
        if int(&balance, intern!(py, "outstanding"))? != 0 || int(&balance, intern!(py, "pending"))? != 0
            || int(&balance, intern!(py, "awaiting_confirmation"))? != 0 {
            return Ok(());
        }
    }
    parent.set_item(intern!(py, "status"), PARENT_CLOSED)?;
    if item(parent, intern!(py, "outcome"))?.is_none() {
        parent.set_item(intern!(py, "outcome"), "expired")?;
    }
    parent.set_item(intern!(py, "closed_at_ms"), ctx.now_ms)?;
    let parent_id = item(parent, intern!(py, "parent_id"))?;
    let retention = py.import("branch_settlement.projections.model")?.getattr("CLOSED_PARENT_RETENTION_MS")?;
    if !retention.is_none() {
        let retention: i64 = retention.extract()?;
        ctx.add_timer(ctx.now_ms + retention, TIMER_PARENT_RETENTION, &parent_id, None)?;
    }
    ctx.audit(&parent_id, None, &prior, PARENT_CLOSED, "parent settled", None, None)?;
    let summary = PyDict::new(py);
    summary.set_item(intern!(py, "parent_id"), &parent_id)?;
    summary.set_item(intern!(py, "outcome"), item(parent, intern!(py, "outcome"))?)?;
    let copies = PyDict::new(py);
    for (dim, balance) in dims.iter() {
        copies.set_item(dim, balance.downcast::<PyDict>()?.copy()?)?;
    }
    summary.set_item(intern!(py, "dimensions"), copies)?;
    summary.set_item(intern!(py, "idempotency_key"), &ctx.key)?;
    summary.set_item(intern!(py, "triggering_event_id"), &ctx.event_id)?;
    summary.set_item(intern!(py, "input_partition"), &ctx.partition)?;
    summary.set_item(intern!(py, "input_offset"), &ctx.offset)?;
    summary.set_item(intern!(py, "ledger_time_ms"), ctx.now_ms)?;
    ctx.settled.append(summary)?;
    ctx.touch(parent, None)
}

// -- handlers.py: the checks every child event starts with ----------------------------------------------------

/// handlers._parent
fn find_parent<'py>(ctx: &Ctx<'py>, core: &Env, open_only: bool) -> Step<Bound<'py, PyDict>> {
    let py = ctx.py;
    let parent_id = ctx.field(intern!(py, "parent_id"))?;
    let Some(parent) = ctx.parent(&parent_id)? else {
        return reject(UNKNOWN_PARENT, format!("no parent {}", repr(&parent_id)?));
    };
    let status = item(&parent, intern!(py, "status"))?;
    let status_text = status.downcast::<PyString>().map_err(PyErr::from)?.to_str()?;
    if status_text == PARENT_CLOSED {
        let detail = core.closed_detail.bind(py).call1((&parent,))?;
        return reject(PARENT_CLOSED_CODE, text(&detail)?);
    }
    if open_only && status_text != PARENT_OPEN {
        return reject(PARENT_CLOSED_CODE, format!("parent {} is {status_text}: new work is fenced",
                                                  repr(&parent_id)?));
    }
    Ok(parent)
}

/// handlers._child
fn find_child<'py>(ctx: &Ctx<'py>, parent: &Bound<'py, PyDict>, child_id: &Bound<'py, PyAny>)
                   -> Step<Bound<'py, PyDict>> {
    let parent_id = item(parent, intern!(ctx.py, "parent_id"))?;
    match ctx.child(&parent_id, child_id)? {
        Some(child) => Ok(child),
        None => reject(UNKNOWN_CHILD, format!("no child {} of parent {}", repr(child_id)?, repr(&parent_id)?)),
    }
}

/// handlers._check_dimensions
fn check_dimensions(parent: &Bound<'_, PyDict>, quantities: Option<&Bound<'_, PyAny>>, field: &str) -> Step<()> {
    let Some(quantities) = quantities else { return Ok(()) };
    if !quantities.is_truthy()? {
        return Ok(());
    }
    let quantities = quantities.downcast::<PyDict>().map_err(PyErr::from)?;
    let dims = sub_dict(parent, intern!(parent.py(), "dimensions"))?;
    let mut unknown = Vec::new();
    for dim in quantities.keys() {
        if !dims.contains(&dim)? {
            unknown.push(dim.downcast::<PyString>().map_err(PyErr::from)?.to_str()?.to_owned());
        }
    }
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort();
    reject(INVALID_EVENT, format!("{field} names dimensions the parent does not have: {}", unknown.join(", ")))
}

/// handlers._escalate: the usage of a report that may not settle the child is kept as audit records.
fn escalate<'py>(ctx: &Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>, code: &'static str,
                 detail: String) -> Step<()> {
    let py = ctx.py;
    let parent_id = item(parent, intern!(py, "parent_id"))?;
    let state = state_of(child)?;
    let state = state.to_str()?;
    let usage = ctx.event.get_item(intern!(py, "usage"))?;
    let usage = match usage {
        Some(usage) if usage.is_truthy()? => Some(usage.downcast_into::<PyDict>().map_err(PyErr::from)?),
        _ => None,
    };
    match usage {
        Some(usage) => {
            let note = format!("escalation ({code}): usage reported but not committed: {detail}");
            for (_, dim) in sorted_keys(&usage)? {
                let quantity: i64 = usage.get_item(&dim)?.expect("a key of the dict").extract()?;
                ctx.audit(&parent_id, Some(child), state, state, &note, Some(&dim), Some(quantity))?;
            }
        }
        None => ctx.audit(&parent_id, Some(child), state, state, &format!("escalation ({code}): {detail}"),
                          None, None)?,
    }
    reject(code, detail)
}

/// handlers._check_attempt
fn check_attempt<'py>(ctx: &Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>,
                      attempt_id: &Bound<'py, PyAny>) -> Step<()> {
    let held = item(child, intern!(ctx.py, "attempt_id"))?;
    if attempt_id.ne(&held)? {
        let child_id = item(child, intern!(ctx.py, "child_id"))?;
        return escalate(ctx, parent, child, SUPERSEDED_ATTEMPT,
                        format!("attempt {} does not hold child {} (held by {})", repr(attempt_id)?,
                                repr(&child_id)?, repr(&held)?));
    }
    Ok(())
}

/// handlers._held_child (attempt field `attempt_id`, usage field `usage`)
fn held_child<'py>(ctx: &Ctx<'py>, core: &Env) -> Step<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let py = ctx.py;
    let parent = find_parent(ctx, core, false)?;
    let child = find_child(ctx, &parent, &ctx.field(intern!(py, "child_id"))?)?;
    check_dimensions(&parent, ctx.event.get_item(intern!(py, "usage"))?.as_ref(), "usage")?;
    check_attempt(ctx, &parent, &child, &ctx.field(intern!(py, "attempt_id"))?)?;
    let state = state_of(&child)?;
    let state = state.to_str()?;
    if is_settled(state) {
        let child_id = item(&child, intern!(py, "child_id"))?;
        return reject(ALREADY_SETTLED, format!("child {} is {state}", repr(&child_id)?));
    }
    Ok((parent, child))
}

/// handlers._report_target, for the reports that never enter reconciliation themselves
fn report_target<'py>(ctx: &Ctx<'py>, core: &Env) -> Step<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let py = ctx.py;
    let (parent, child) = held_child(ctx, core)?;
    let state = state_of(&child)?;
    let state = state.to_str()?;
    if state == STRANDED {
        escalate(ctx, &parent, &child, INVALID_TRANSITION,
                 "child is stranded: only an operator's ReconciliationResolved settles it".to_owned())?;
    }
    let generation: i64 = ctx.field(intern!(py, "lease_generation"))?.extract()?;
    let held = int(&child, intern!(py, "lease_generation"))?;
    if generation < held {
        escalate(ctx, &parent, &child, STALE_LEASE_GENERATION,
                 format!("lease generation {generation} superseded by {held}"))?;
    }
    if generation > held && is_pending(state) {
        escalate(ctx, &parent, &child, INVALID_TRANSITION,
                 format!("lease generation {generation} is unknown to the ledger ({held}) and the child is in \
                          reconciliation"))?;
    }
    Ok((parent, child))
}

/// handlers._adopt_report
fn adopt_report<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>,
                     proves_execution: bool) -> PyResult<()> {
    let py = ctx.py;
    let generation: i64 = ctx.field(intern!(py, "lease_generation"))?.extract()?;
    if generation > int(child, intern!(py, "lease_generation"))? {
        child.set_item(intern!(py, "lease_generation"), generation)?;
        let state = state_of(child)?;
        let state = state.to_str()?;
        let parent_id = item(parent, intern!(py, "parent_id"))?;
        ctx.audit(&parent_id, Some(child), state, state, "implied lease renewal", None, None)?;
    }
    if proves_execution && !item(child, intern!(py, "activated"))?.is_truthy()? {
        child.set_item(intern!(py, "activated"), true)?;
        let prior = state_of(child)?;
        let prior = prior.to_str()?;
        let new_state = if prior == RESERVED { ACTIVATED } else { prior };
        set_state(ctx, parent, child, new_state, "implied activation")?;
    }
    Ok(())
}

/// handlers._check_headroom
fn check_headroom(parent: &Bound<'_, PyDict>, usage: &Bound<'_, PyAny>) -> Step<()> {
    if usage.is_none() || !usage.is_truthy()? {
        return Ok(());
    }
    let py = parent.py();
    let dims = sub_dict(parent, intern!(py, "dimensions"))?;
    for (dim, quantity) in usage.downcast::<PyDict>().map_err(PyErr::from)?.iter() {
        let balance = sub_dict(&dims, dim.downcast().map_err(PyErr::from)?)?;
        let quantity: i64 = quantity.extract()?;
        let held = int(&balance, intern!(py, "committed"))?
            .max(int(&balance, intern!(py, "capacity"))? + int(&balance, intern!(py, "overdrawn"))?);
        if held + quantity > MAX_BALANCE {
            return reject(LIMIT_EXCEEDED, format!("{}: committing {quantity} would take the ledger past {MAX_BALANCE}",
                                                  text(&dim)?));
        }
    }
    Ok(())
}

fn usage_dict<'py>(ctx: &Ctx<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
    let usage = ctx.field(intern!(ctx.py, "usage"))?;
    Ok(if usage.is_none() { None } else { Some(usage.downcast_into()?) })
}

// -- handlers.py: the four compiled event types -----------------------------------------------------------------

/// handlers.child_reserved
fn child_reserved<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let py = ctx.py;
    let parent = find_parent(ctx, core, true)?;
    let parent_id = item(&parent, intern!(py, "parent_id"))?;
    let child_id = ctx.field(intern!(py, "child_id"))?;
    if ctx.child(&parent_id, &child_id)?.is_some() {
        return reject(INVALID_TRANSITION, format!("child {} is already reserved", repr(&child_id)?));
    }
    let quantities = ctx.field(intern!(py, "quantities"))?;
    check_dimensions(&parent, Some(&quantities), "quantities")?;
    let quantities = quantities.downcast_into::<PyDict>().map_err(PyErr::from)?;
    let children = item(&parent, intern!(py, "children"))?.downcast_into::<PyList>().map_err(PyErr::from)?;
    if children.len() >= MAX_CHILDREN_PER_PARENT {
        return reject(LIMIT_EXCEEDED, format!("a parent has at most {MAX_CHILDREN_PER_PARENT} children"));
    }
    let live = int(&parent, intern!(py, "live_children"))?;
    let max_live = int(&parent, intern!(py, "max_live_children"))?;
    if live >= max_live {
        return reject(FANOUT_EXCEEDED, format!("{live} live children, at most {max_live}"));
    }
    let dims = sub_dict(&parent, intern!(py, "dimensions"))?;
    let sorted = sorted_keys(&quantities)?;
    let mut short = Vec::new();
    for (name, dim) in &sorted {
        let quantity: i64 = quantities.get_item(dim)?.expect("a key of the dict").extract()?;
        let available = int(&sub_dict(&dims, dim.downcast().map_err(PyErr::from)?)?, intern!(py, "available"))?;
        if quantity > available {
            short.push(format!("{name} {quantity} > available {available}"));
        }
    }
    if !short.is_empty() {
        if item(&parent, intern!(py, "loans"))?.is_truthy()? {
            return Err(Fail::Delegate); // lent capacity may cover it: loans are recalled (handlers._short_of_available)
        }
        return reject(EXCEEDS_AVAILABLE, short.join("; "));
    }
    for (dim, quantity) in quantities.iter() {
        let quantity: i64 = quantity.extract()?;
        let balance = sub_dict(&dims, dim.downcast().map_err(PyErr::from)?)?;
        add(&balance, intern!(py, "available"), -quantity)?;
        add(&balance, intern!(py, "outstanding"), quantity)?;
    }
    // model.new_child
    let child = presized(py, 16)?;
    let reserved = PyDict::new(py);
    let consumed = PyDict::new(py);
    for (_, dim) in &sorted {
        reserved.set_item(dim, quantities.get_item(dim)?.expect("a key of the dict"))?;
        consumed.set_item(dim, 0)?;
    }
    child.set_item(intern!(py, "parent_id"), &parent_id)?;
    child.set_item(intern!(py, "child_id"), &child_id)?;
    child.set_item(intern!(py, "branch_id"), ctx.field(intern!(py, "branch_id"))?)?;
    child.set_item(intern!(py, "attempt_id"), ctx.field(intern!(py, "attempt_id"))?)?;
    child.set_item(intern!(py, "state"), RESERVED)?;
    child.set_item(intern!(py, "activated"), false)?;
    child.set_item(intern!(py, "lease_generation"), 0)?;
    child.set_item(intern!(py, "lease_expires_at_ms"), py.None())?;
    child.set_item(intern!(py, "reconcile_deadline_ms"), py.None())?;
    child.set_item(intern!(py, "reserved"), reserved)?;
    child.set_item(intern!(py, "consumed"), consumed)?;
    child.set_item(intern!(py, "earlier_attempts_consumed"), PyDict::new(py))?;
    child.set_item(intern!(py, "awaiting"), PyDict::new(py))?;
    child.set_item(intern!(py, "awaiting_destination"), PyDict::new(py))?;
    child.set_item(intern!(py, "escalated"), PyDict::new(py))?;
    child.set_item(intern!(py, "usage_report_ids"), PyList::empty(py))?;
    children.append(&child_id)?;
    add(&parent, intern!(py, "live_children"), 1)?;
    add(&parent, intern!(py, "open_children"), 1)?;
    ctx.audit(&parent_id, Some(&child), "", RESERVED, "child reserved", None, None)?;
    ctx.touch(&parent, Some(&child))?;
    Ok(())
}

/// handlers.child_activated
fn child_activated<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let py = ctx.py;
    let parent = find_parent(ctx, core, true)?;
    let child = find_child(ctx, &parent, &ctx.field(intern!(py, "child_id"))?)?;
    let state = state_of(&child)?;
    let state = state.to_str()?;
    let child_id = item(&child, intern!(py, "child_id"))?;
    if is_settled(state) || is_pending(state) {
        return reject(DISPATCH_FENCED, format!("child {} is {state}", repr(&child_id)?));
    }
    check_attempt(ctx, &parent, &child, &ctx.field(intern!(py, "attempt_id"))?)?;
    let activated = item(&child, intern!(py, "activated"))?.is_truthy()?;
    if state == CANCEL_REQUESTED && !activated {
        return reject(DISPATCH_FENCED, "cancel was requested before activation".to_owned());
    }
    if activated {
        return reject(INVALID_TRANSITION, format!("child {} is already activated", repr(&child_id)?));
    }
    let generation: i64 = ctx.field(intern!(py, "lease_generation"))?.extract()?;
    let held = int(&child, intern!(py, "lease_generation"))?;
    if generation < held {
        return reject(STALE_LEASE_GENERATION, format!("lease generation {generation} superseded by {held}"));
    }
    child.set_item(intern!(py, "activated"), true)?;
    child.set_item(intern!(py, "lease_generation"), generation)?;
    // handlers._start_lease
    let ttl: i64 = ctx.field(intern!(py, "lease_ttl_ms"))?.extract()?;
    let deadline_ms = ctx.now_ms + ttl;
    child.set_item(intern!(py, "lease_expires_at_ms"), deadline_ms)?;
    let parent_id = item(&parent, intern!(py, "parent_id"))?;
    ctx.add_timer(deadline_ms, TIMER_CHILD_LEASE, &parent_id, Some(&child_id))?;
    set_state(ctx, &parent, &child, ACTIVATED, "dispatch confirmed")?;
    Ok(())
}

/// handlers.usage_reported
fn usage_reported<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let py = ctx.py;
    let (parent, child) = report_target(ctx, core)?;
    let report_id = ctx.field(intern!(py, "usage_report_id"))?;
    let ids = item(&child, intern!(py, "usage_report_ids"))?.downcast_into::<PyList>().map_err(PyErr::from)?;
    if ids.contains(&report_id)? {
        return reject(DUPLICATE_USAGE_REPORT, format!("usage report {} was already counted", repr(&report_id)?));
    }
    let last = ctx.field(intern!(py, "final"))?.is_truthy()?;
    if ids.len() >= MAX_USAGE_REPORTS_PER_ATTEMPT && !last {
        return reject(LIMIT_EXCEEDED, format!("an attempt has at most {MAX_USAGE_REPORTS_PER_ATTEMPT} usage reports: \
                                               report the total in its completion"));
    }
    let usage = ctx.field(intern!(py, "usage"))?;
    check_headroom(&parent, &usage)?;
    adopt_report(ctx, &parent, &child, true)?;
    ids.append(&report_id)?;
    let usage = usage.downcast_into::<PyDict>().map_err(PyErr::from)?;
    commit_usage(ctx, &parent, &child, &usage)?;
    if last {
        settle(ctx, &parent, &child, None, "final_usage", "")?;
    } else if state_of(&child)?.to_str()? == ACTIVATED {
        set_state(ctx, &parent, &child, PARTIALLY_CONSUMED, "usage reported")?;
    }
    Ok(())
}

/// handlers.child_completed
fn child_completed<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let (parent, child) = report_target(ctx, core)?;
    let usage = ctx.field(intern!(ctx.py, "usage"))?;
    check_headroom(&parent, &usage)?;
    adopt_report(ctx, &parent, &child, true)?;
    let usage = usage_dict(ctx)?;
    settle(ctx, &parent, &child, usage.as_ref(), "completed", "")?;
    Ok(())
}

/// handlers.child_skipped
fn child_skipped<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let py = ctx.py;
    let (parent, child) = held_child(ctx, core)?;
    let state = state_of(&child)?;
    if item(&child, intern!(py, "activated"))?.is_truthy()? || is_pending(state.to_str()?) {
        return reject(INVALID_TRANSITION,
                      "a skip is only valid before activation; report the outcome instead".to_owned());
    }
    release_remainder(ctx, &parent, &child, "skipped")?;
    let reason = text(&ctx.field(intern!(py, "reason"))?)?;
    set_state(ctx, &parent, &child, RELEASED, &format!("skipped: {reason}"))?;
    finish_parent_if_done(ctx, &parent)?;
    Ok(())
}

/// handlers.speculative_winner
fn speculative_winner<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let py = ctx.py;
    let parent = find_parent(ctx, core, false)?;
    let parent_id = item(&parent, intern!(py, "parent_id"))?;
    let branch_id = ctx.field(intern!(py, "branch_id"))?;
    let winner_id = ctx.field(intern!(py, "winner_attempt_id"))?;
    let mut branch = Vec::new();
    for child_id in item(&parent, intern!(py, "children"))?.try_iter()? {
        // a child the parent names and the ledger has not: the Python fold says what that is
        let Some(child) = ctx.child(&parent_id, &child_id?)? else { return Err(Fail::Delegate) };
        if item(&child, intern!(py, "branch_id"))?.eq(&branch_id)? {
            branch.push(child);
        }
    }
    let mut winners = Vec::new();
    for child in &branch {
        if item(child, intern!(py, "attempt_id"))?.eq(&winner_id)? {
            winners.push(child);
        }
    }
    if winners.is_empty() {
        return reject(UNKNOWN_CHILD, format!("no child of branch {} is held by attempt {}", repr(&branch_id)?,
                                             repr(&winner_id)?));
    }
    for child in &winners {
        if state_of(child)?.to_str()? == STRANDED {
            return reject(INVALID_TRANSITION, format!("the winning attempt {} holds a stranded child",
                                                      repr(&winner_id)?));
        }
    }
    let named_winners = sub_dict(&parent, intern!(py, "winners"))?;
    if let Some(named) = named_winners.get_item(&branch_id)? {
        if !named.is_none() && named.ne(&winner_id)? {
            return reject(INVALID_TRANSITION, format!("branch {} already has winner {}", repr(&branch_id)?,
                                                      repr(&named)?));
        }
    }
    named_winners.set_item(&branch_id, &winner_id)?;
    let status = text(&item(&parent, intern!(py, "status"))?)?;
    ctx.audit(&parent_id, None, &status, &status,
              &format!("speculative winner of branch {}: {}", text(&branch_id)?, text(&winner_id)?), None, None)?;
    for loser in &branch {
        let state = state_of(loser)?;
        if item(loser, intern!(py, "attempt_id"))?.eq(&winner_id)? || !is_live(state.to_str()?) {
            continue;
        }
        if !item(loser, intern!(py, "activated"))?.is_truthy()? {
            // never dispatched, and now fenced: nothing can have run, so all of it returns
            release_remainder(ctx, &parent, loser, "speculative_loser")?;
            set_state(ctx, &parent, loser, RELEASED, "speculative loser, never activated")?;
        } else if state.to_str()? != CANCEL_REQUESTED {
            set_state(ctx, &parent, loser, CANCEL_REQUESTED, "speculative loser: asked to cancel")?;
        }
    }
    ctx.touch(&parent, None)?;
    finish_parent_if_done(ctx, &parent)?;
    Ok(())
}

/// handlers._settle_outcome, for a known usage (plainly_valid leaves an uncertain one to the Python fold)
fn settle_outcome<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, child: &Bound<'py, PyDict>, reason: &str,
                       note: &str) -> Step<()> {
    let py = ctx.py;
    let usage = ctx.field(intern!(py, "usage"))?.downcast_into::<PyDict>().map_err(PyErr::from)?; // `usage or {}`
    check_headroom(parent, usage.as_any())?;
    let activated = match ctx.event.get_item(intern!(py, "activated"))? {
        Some(activated) => activated.is_truthy()?,
        None => false,
    };
    let mut positive = false;
    for quantity in usage.values() {
        positive |= quantity.extract::<i64>()? > 0;
    }
    adopt_report(ctx, parent, child, activated || positive)?;
    let retry = ctx.event.get_item(intern!(py, "retry_attempt_id"))?;
    if let Some(retry) = retry.filter(|r| r.is_truthy().unwrap_or(false)) {
        if item(parent, intern!(py, "status"))?.downcast::<PyString>().map_err(PyErr::from)?.to_str()? == PARENT_OPEN {
            hand_to_retry(ctx, parent, child, &usage, &retry)?;
            return Ok(());
        }
    }
    settle(ctx, parent, child, Some(&usage), reason, note)?;
    Ok(())
}

/// handlers.cancel_acknowledged, its usage known
fn cancel_acknowledged<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let (parent, child) = report_target(ctx, core)?;
    settle_outcome(ctx, &parent, &child, "cancel_acknowledged", "")
}

/// handlers.child_failed, its usage known (never then a failure the ledger must take as uncertain)
fn child_failed<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let (parent, child) = report_target(ctx, core)?;
    let reason = text(&ctx.field(intern!(ctx.py, "reason"))?)?;
    settle_outcome(ctx, &parent, &child, "failed", &reason)
}

// -- handlers.py: parents --------------------------------------------------------------------------------------

/// handlers.parent_reserved; the parent itself made by model.new_parent.
fn parent_reserved<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let py = ctx.py;
    let parent_id = ctx.field(intern!(py, "parent_id"))?;
    if let Some(existing) = ctx.parent(&parent_id)? {
        if text(&item(&existing, intern!(py, "status"))?)? == PARENT_CLOSED {
            let detail = core.closed_detail.bind(py).call1((&existing,))?;
            return reject(PARENT_CLOSED_CODE, text(&detail)?);
        }
        return reject(INVALID_TRANSITION, format!("parent {} is already reserved", repr(&parent_id)?));
    }
    let capacity = ctx.field(intern!(py, "capacity"))?;
    let policy = ctx.field(intern!(py, "policy"))?.downcast_into::<PyDict>().map_err(PyErr::from)?;
    let dimensions = PyDict::new(py);
    dimensions.set_item(intern!(py, "dimensions"), &capacity)?;
    check_dimensions(&dimensions, Some(&item(&policy, intern!(py, "lending_limit"))?), "lending_limit")?;
    let lease_expires_at_ms = ctx.now_ms + int(&ctx.event, intern!(py, "lease_ttl_ms"))?;
    let parent = core.new_parent.bind(py).call1((&parent_id, &capacity, lease_expires_at_ms, &policy))?;
    let parent = parent.downcast_into::<PyDict>().map_err(PyErr::from)?;
    ctx.add_timer(lease_expires_at_ms, TIMER_PARENT_LEASE, &parent_id, None)?;
    ctx.audit(&parent_id, None, "", PARENT_OPEN, "parent reserved", None, None)?;
    ctx.touch(&parent, None)?;
    Ok(())
}

/// handlers.parent_closed. A parent with a loan to ask back (accounting.ask_loan_back, a revocation) goes to the
/// Python fold, and so does one that names a child the ledger has not: both before anything changed.
fn parent_closed<'py>(ctx: &mut Ctx<'py>, core: &Env) -> Step<()> {
    let py = ctx.py;
    let parent = find_parent(ctx, core, false)?;
    let parent_id = item(&parent, intern!(py, "parent_id"))?;
    let prior = item(&parent, intern!(py, "status"))?.downcast_into::<PyString>().map_err(PyErr::from)?;
    let prior = prior.to_str()?.to_owned();
    if prior == PARENT_CLOSING {
        return reject(INVALID_TRANSITION, format!("parent {} is already closing", repr(&parent_id)?));
    }
    // the children fence_parent goes through, each read once, in the parent's order
    let mut children = Vec::new();
    if prior == PARENT_OPEN {
        for loan in item(&parent, intern!(py, "loans"))?.try_iter()? {
            let loan = loan?.downcast_into::<PyDict>().map_err(PyErr::from)?;
            if text(&item(&loan, intern!(py, "state"))?)? == LOAN_OPEN
                && !item(&loan, intern!(py, "revocation_requested"))?.is_truthy()? {
                return Err(Fail::Delegate);
            }
        }
        for child_id in item(&parent, intern!(py, "children"))?.try_iter()? {
            let Some(child) = ctx.child(&parent_id, &child_id?)? else { return Err(Fail::Delegate) };
            children.push(child);
        }
    }
    let outcome = ctx.field(intern!(py, "outcome"))?;
    parent.set_item(intern!(py, "outcome"), &outcome)?;
    let outcome = text(&outcome)?;
    if prior == PARENT_OPEN {
        parent.set_item(intern!(py, "status"), state_name(py, PARENT_CLOSING))?;
        ctx.audit(&parent_id, None, &prior, PARENT_CLOSING, &format!("parent closed: {outcome}"), None, None)?;
        fence_parent(ctx, &parent, &children, "parent_closed")?;
    } else {
        ctx.audit(&parent_id, None, &prior, &prior, &format!("close recorded on expired parent: {outcome}"), None,
                  None)?;
    }
    ctx.touch(&parent, None)?;
    finish_parent_if_done(ctx, &parent)?;
    Ok(())
}

/// accounting.fence_parent, for a parent with no loan to ask back, over its `children` (all of them, in order)
fn fence_parent<'py>(ctx: &mut Ctx<'py>, parent: &Bound<'py, PyDict>, children: &[Bound<'py, PyDict>],
                     reason: &str) -> PyResult<()> {
    let py = ctx.py;
    for (dim, balance) in sub_dict(parent, intern!(py, "dimensions"))?.iter() {
        let balance = balance.downcast_into::<PyDict>()?;
        let quantity = int(&balance, intern!(py, "available"))?;
        if quantity != 0 {
            balance.set_item(intern!(py, "available"), 0)?;
            add(&balance, intern!(py, "returned_to_pool"), quantity)?;
            ctx.release(parent, None, &dim, quantity, DESTINATION_POOL, reason)?;
        }
    }
    for child in children {
        let state = state_of(child)?;
        if is_live(state.to_str()?) && !item(child, intern!(py, "activated"))?.is_truthy()? {
            release_remainder(ctx, parent, child, reason)?;
            set_state(ctx, parent, child, RELEASED, &format!("{reason}: never activated, dispatch fenced"))?;
        }
    }
    ctx.touch(parent, None)
}

// -- fold.py ------------------------------------------------------------------------------------------------------

/// What fold.py hands the core once: the Python functions it calls on the rare paths.
struct Env {
    digest: Py<PyAny>,
    digest_writers: Py<PyAny>,
    decoded_size: Py<PyAny>,
    closed_detail: Py<PyAny>,
    raise_violation: Py<PyAny>,
    event_context: Py<PyAny>,
    new_parent: Py<PyAny>,
}

/// The compiled per-event path of one `Fold` (processors/ledger/fold.py), which it calls back for every event it
/// does not compile.
#[pyclass(frozen, module = "branch_settlement_native")]
pub struct FoldCore {
    env: Env,
    // The fold's, fixed when it is made: its view (with the view's cache and changes), partition and partitions.
    view: Py<PyAny>,
    cache: Py<PyDict>,
    dirty: Py<PyDict>,
    sizes: Py<PyDict>,
    store: Py<PyAny>,
    decode: Py<PyAny>,
    digests: pyo3::sync::GILOnceCell<Py<PyDict>>,
    // The compiled writer of idempotency records of the fold's `_change_writers`, once known (None: there is none).
    idempotency_writer: pyo3::sync::GILOnceCell<Option<(Py<crate::Encoder>, Option<crate::SlotOrder>)>>,
    // The same for timer records.
    timer_writer: pyo3::sync::GILOnceCell<Option<(Py<crate::Encoder>, Option<crate::SlotOrder>)>>,
    partition: Py<PyAny>,
    partition_number: i64,
    partitions: Option<u32>,
}

#[pymethods]
impl FoldCore {
    /// `fold`: the Python Fold, whose view, partition and partitions are read once, here (the core keeps no
    /// reference to the fold itself, which holds the core); `env`: fold.py's functions and the contract's names and
    /// limits, checked here.
    #[new]
    fn new(fold: Bound<'_, PyAny>, env: &Bound<'_, PyDict>) -> PyResult<Self> {
        let contract = env.get_item("contract")?.ok_or_else(|| PyValueError::new_err("no contract"))?;
        let contract = contract.downcast::<PyDict>()?;
        for (name, value) in CONTRACT {
            let given = contract.get_item(*name)?;
            let agrees = match (value, &given) {
                (Value::S(s), Some(given)) => given.extract::<String>().map(|g| g == *s).unwrap_or(false),
                (Value::I(i), Some(given)) => given.extract::<i64>().map(|g| g == *i).unwrap_or(false),
                _ => false,
            };
            if !agrees {
                return Err(PyValueError::new_err(format!(
                    "branch-settlement-native was built for another contract: {name} is {given:?} in Python; \
                     rebuild it (`make install`)")));
            }
        }
        let get = |name: &str| -> PyResult<Py<PyAny>> {
            Ok(env.get_item(name)?.ok_or_else(|| PyValueError::new_err(format!("no {name}")))?.unbind())
        };
        let view = fold.getattr("view")?;
        let partition = fold.getattr("partition")?;
        let partitions = fold.getattr("partitions")?;
        Ok(FoldCore {
            cache: view.getattr("_cache")?.downcast_into::<PyDict>()?.unbind(),
            dirty: view.getattr("_dirty")?.downcast_into::<PyDict>()?.unbind(),
            sizes: view.getattr("_sizes")?.downcast_into::<PyDict>()?.unbind(),
            store: view.getattr("store")?.unbind(),
            decode: view.getattr("_decode")?.unbind(),
            digests: pyo3::sync::GILOnceCell::new(),
            idempotency_writer: pyo3::sync::GILOnceCell::new(),
            timer_writer: pyo3::sync::GILOnceCell::new(),
            view: view.unbind(),
            partition_number: partition.extract()?,
            partition: partition.unbind(),
            partitions: if partitions.is_none() { None } else { Some(partitions.extract()?) },
            env: Env {
                digest: get("payload_digest")?,
                digest_writers: get("digest_writers")?,
                decoded_size: get("decoded_size")?,
                closed_detail: get("closed_detail")?,
                raise_violation: get("raise_violation")?,
                event_context: get("event_context")?,
                new_parent: get("new_parent")?,
            },
        })
    }

    /// LedgerView.changes of the fold's view: the checkpoint's changes, encoded, in the order first made, each
    /// cached record's size estimated again from its encoding. `writers`: the codec's compiled writer per record
    /// name (`Codec.plain_encoders`); `encode`: Codec.encode, for a record they leave to fastavro.
    fn changes<'py>(&self, py: Python<'py>, writers: &Bound<'py, PyDict>, encode: &Bound<'py, PyAny>)
                    -> PyResult<Bound<'py, PyList>> {
        let (dirty, sizes, view) = (self.dirty.bind(py), self.sizes.bind(py), self.view.bind(py));
        let decoded_size = self.env.decoded_size.bind(py);
        let changes = PyList::empty(py);
        let mut buffer = Vec::with_capacity(1024);
        let mut charged: i64 = 0;
        let outcome = (|| -> PyResult<()> {
            for (key, entry) in dirty.iter() {
                if entry.is_none() {
                    changes.append((key, py.None()))?;
                    continue;
                }
                let entry = entry.downcast_into::<pyo3::types::PyTuple>()?;
                let value = entry.get_item(1)?;
                if value.is_exact_instance_of::<PyBytes>() {
                    changes.append((key, value))?;
                    continue;
                }
                let name = entry.get_item(0)?;
                let writer = writers.get_item(&name)?;
                let encoded = match writer.as_ref().and_then(|w| w.downcast::<crate::Encoder>().ok()) {
                    Some(writer) => match writer.get().encode_with(py, &value, &mut buffer) {
                        Ok(bytes) => bytes.into_any(),
                        Err(crate::NotPlain) => encode.call1((&name, &value))?,
                    },
                    None => encode.call1((&name, &value))?,
                };
                if let Some(before) = sizes.get_item(&key)? {
                    let length = encoded.len()?;
                    let size = decoded_size.call1((&key, length))?;
                    charged += size.extract::<i64>()? - before.extract::<i64>()?;
                    sizes.set_item(&key, size)?;
                }
                changes.append((key, encoded))?;
            }
            Ok(())
        })();
        if charged != 0 {
            let cached: i64 = view.getattr(intern!(py, "cached_bytes"))?.extract()?;
            view.setattr(intern!(py, "cached_bytes"), cached + charged)?;
        }
        outcome.map(|()| changes)
    }

    /// Fold.apply, of `fold` (the Fold that made this core: its `_apply` takes what is not compiled here)
    pub(crate) fn apply<'py>(&self, py: Python<'py>, fold: &Bound<'py, PyAny>, event: &Bound<'py, PyAny>,
                  offset: &Bound<'py, PyAny>, out: &Bound<'py, PyAny>, ledger_tick: bool)
                  -> PyResult<Bound<'py, PyAny>> {
        match self.apply_with(py, fold, event, offset, out, &OutLists::of(out, None)?, ledger_tick, None)? {
            Applied::Dict(result) => Ok(result),
            Applied::Direct { .. } => unreachable!("results are written as dicts unless asked otherwise"),
        }
    }
}

impl FoldCore {
    /// Fold.apply, with the result and the audit records of an event the core takes written by `direct`'s writers
    /// at once (the bytes OutputEncoder writes from their dicts), or as dicts into `out` (FoldCore::apply, Fold.apply).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn apply_with<'py>(&self, py: Python<'py>, fold: &Bound<'py, PyAny>, event: &Bound<'py, PyAny>,
                                  offset: &Bound<'py, PyAny>, out: &Bound<'py, PyAny>, lists: &OutLists<'py>,
                                  ledger_tick: bool, direct: Option<&Direct>) -> PyResult<Applied<'py>> {
        let delegate = || {
            fold.call_method1(intern!(py, "_apply"), (event, offset, out, ledger_tick)).map(Applied::Dict)
        };
        if ledger_tick {
            return delegate();
        }
        let Ok(event_dict) = event.downcast::<PyDict>() else { return delegate() };
        let Some(etype) = event_dict.get_item(intern!(py, "type"))? else { return delegate() };
        let compiled = match etype.downcast::<PyString>() {
            Ok(name) => COMPILED_TYPES.contains(&name.to_str()?),
            Err(_) => false,
        };
        if !compiled || !plainly_valid(event_dict, etype.downcast::<PyString>()?.to_str()?)? {
            return delegate();
        }
        let parent_id = item(event_dict, intern!(py, "parent_id"))?;
        if let Some(partitions) = self.partitions {
            let hash = murmur2(parent_id.downcast::<PyString>()?.to_str()?.as_bytes()) & 0x7FFF_FFFF;
            if partitions == 0 || i64::from(hash % partitions) != self.partition_number {
                return delegate();
            }
        }
        let view = self.view.bind(py);
        let now_ms: i64 = item(view.getattr(intern!(py, "meta"))?.downcast()?, intern!(py, "ledger_time_ms"))?
            .extract()?;
        let mut ctx = Ctx {
            py,
            cache: self.cache.bind(py).clone(),
            dirty: self.dirty.bind(py).clone(),
            sizes: self.sizes.bind(py).clone(),
            store: self.store.bind(py).clone(),
            decode: self.decode.bind(py).clone(),
            decoded_size: self.env.decoded_size.bind(py).clone(),
            idempotency_writer: change_writer(&self.idempotency_writer, fold, IDEMPOTENCY_RECORD, &IDEMPOTENCY_SLOTS)?,
            timer_writer: change_writer(&self.timer_writer, fold, TIMER_RECORD, &TIMER_SLOTS)?,
            view: view.clone(),
            event: event_dict.clone(),
            etype: etype.clone(),
            event_id: item(event_dict, intern!(py, "event_id"))?,
            key: item(event_dict, intern!(py, "idempotency_key"))?,
            partition: self.partition.bind(py).clone(),
            offset: offset.clone(),
            now_ms,
            audits: lists.audits.clone(),
            releases: lists.releases.clone(),
            settled: lists.settled.clone(),
            touched: Vec::new(),
            touched_children: Vec::new(),
            keys: std::cell::RefCell::new(Vec::with_capacity(KEYS_KEPT)),
            absent_key: std::cell::RefCell::new(None),
            overdrawn: false,
            charged: std::cell::Cell::new(0),
            direct: direct.map(|d| DirectAudits {
                writer: d.audit.bind(py).clone(),
                order: d.audit_order,
                name: d.audit_name.bind(py).clone(),
                encode: d.encode.bind(py).clone(),
                written: std::cell::RefCell::new((Vec::new(), Vec::with_capacity(256))),
                release: d.releases.as_ref().map(|r| (r.encoder.bind(py).clone(), r.order, r.name.bind(py).clone())),
                releases: std::cell::RefCell::new(Vec::new()),
            }),
        };
        let mut once = self.apply_once(&mut ctx, &parent_id);
        if once.is_ok() {
            if let Err(err) = ctx.cache_absent_key() {
                once = Err(Fail::Py(err));
            }
        }
        // whatever the outcome (taken, left to Python, failed), the view's size as the records it now holds
        let settled = ctx.settle_charges();
        let cached = match settled {
            Ok(cached) => cached,
            Err(_) if matches!(once, Err(Fail::Py(_))) => 0, // the fold's own failure is the one raised
            Err(err) => return Err(err),
        };
        let (code, detail) = match once {
            Ok(outcome) => outcome,
            Err(Fail::Delegate) => return delegate(),
            Err(Fail::Py(err)) => return Err(err),
            Err(Fail::Reject(..)) => unreachable!("apply_once returns rejections as outcomes"),
        };
        self.check_invariants(&ctx)?;
        let child_id = match event_dict.get_item(intern!(py, "child_id"))? {
            Some(child_id) => child_id,
            None => py.None().into_bound(py),
        };
        let detail = if detail.is_empty() { intern!(py, "").clone() } else { crate::new_str(py, &detail) };
        let code = code_name(py, code);
        // in RESULT_SLOTS' order
        let values = [ctx.event_id.clone(), ctx.key.clone(), parent_id.clone(), child_id, etype.clone(),
                      code.clone().into_any(), detail.into_any(), ctx.partition.clone(), offset.clone(),
                      ctx.now_ms.into_pyobject(py)?.into_any()];
        let applied = match direct {
            Some(direct) => {
                let mut buffer = Vec::with_capacity(256);
                let value = match direct.result.get().encode_slots(py, &direct.result_order, &values, &mut buffer) {
                    Ok(bytes) => bytes.into_any(),
                    Err(crate::NotPlain) => {
                        let record = slots_dict(py, &RESULT_KEYS, &RESULT_SLOTS, &values)?;
                        direct.encode.bind(py).call1((direct.result_name.bind(py), record))?
                    }
                };
                let (releases, audits) = match ctx.direct.take() {
                    Some(d) => (d.releases.into_inner(), d.written.into_inner().0),
                    None => (Vec::new(), Vec::new()),
                };
                Applied::Direct { code, result: (output_key(&parent_id)?, value), releases, audits }
            }
            None => {
                let result = slots_dict(py, &RESULT_KEYS, &RESULT_SLOTS, &values)?;
                lists.results.append(&result)?;
                Applied::Dict(result.into_any())
            }
        };
        // LedgerView.end_event trims the cache once it holds more than the view's share: asked only then.
        let share: i64 = view.getattr(intern!(py, "_budget"))?.getattr(intern!(py, "share"))?.extract()?;
        if cached > share {
            view.call_method0(intern!(py, "end_event"))?;
        }
        Ok(applied)
    }

    /// LedgerView.change_count: the records the next checkpoint writes.
    pub(crate) fn change_count(&self, py: Python<'_>) -> usize {
        self.dirty.bind(py).len()
    }

    /// Fold._apply_once: (result code, detail)
    fn apply_once<'py>(&self, ctx: &mut Ctx<'py>, parent_id: &Bound<'py, PyAny>) -> Step<(&'static str, String)> {
        let py = ctx.py;
        let digest = self.digest(ctx)?;
        if let Some(stored) = ctx.idempotency(parent_id)? {
            let event_id = text(&item(&stored, intern!(py, "event_id"))?)?;
            if item(&stored, intern!(py, "payload_digest"))?.eq(&digest)? {
                let result = text(&item(&stored, intern!(py, "result"))?)?;
                return Ok((DUPLICATE, format!("original event {event_id} had result {result}")));
            }
            let event_type = text(&item(&stored, intern!(py, "event_type"))?)?;
            return Ok((IDEMPOTENCY_CONFLICT, format!("key {} was used by event {event_id} ({event_type}) with \
                                                      another payload", repr(&ctx.key)?)));
        }
        let handled = match ctx.etype.downcast::<PyString>().map_err(PyErr::from)?.to_str()? {
            "ChildReserved" => child_reserved(ctx, &self.env),
            "ChildActivated" => child_activated(ctx, &self.env),
            "UsageReported" => usage_reported(ctx, &self.env),
            "ChildCompleted" => child_completed(ctx, &self.env),
            "ChildSkipped" => child_skipped(ctx, &self.env),
            "CancelAcknowledged" => cancel_acknowledged(ctx, &self.env),
            "ChildFailed" => child_failed(ctx, &self.env),
            "SpeculativeWinner" => speculative_winner(ctx, &self.env),
            "ParentClosed" => parent_closed(ctx, &self.env),
            "ParentReserved" => parent_reserved(ctx, &self.env),
            _ => Err(Fail::Delegate),
        };
        match handled {
            Ok(()) => {}
            Err(Fail::Reject(code, detail)) => return Ok((code, detail)),
            Err(other) => return Err(other),
        }
        let code = if ctx.overdrawn { OVERDRAWN } else { OK };
        // in IDEMPOTENCY_SLOTS' order
        let values = [digest.downcast::<PyBytes>().map_err(PyErr::from)?.clone().into_any(), ctx.etype.clone(),
                      code_name(py, code).clone().into_any(), ctx.event_id.clone()];
        ctx.put_idempotency(parent_id, &values)?;
        Ok((code, String::new()))
    }

    /// fold.payload_digest: the compiled digest of the event's type, called here; where it is not sure, or the
    /// digests are the Python ones, fold.py's payload_digest.
    fn digest<'py>(&self, ctx: &Ctx<'py>) -> PyResult<Bound<'py, PyAny>> {
        let py = ctx.py;
        let writers = self.digests
            .get_or_try_init(py, || -> PyResult<Py<PyDict>> {
                Ok(self.env.digest_writers.bind(py).call0()?.downcast_into::<PyDict>()?.unbind())
            })?
            .bind(py);
        if let Some(writer) = writers.get_item(&ctx.etype)? {
            if let Ok(writer) = writer.downcast::<crate::SortedJsonDigest>() {
                if let Some(digest) = writer.get().digest(py, &ctx.event) {
                    return Ok(digest.into_any());
                }
            }
        }
        self.env.digest.bind(py).call1((&ctx.event,))
    }

    /// fold.check_invariant on every parent the event changed; a violation is described and raised by fold.py.
    fn check_invariants(&self, ctx: &Ctx<'_>) -> PyResult<()> {
        let py = ctx.py;
        for (_, parent) in &ctx.touched {
            if self.holds(parent)? {
                continue;
            }
            let context = self.env.event_context.bind(py).call1((&ctx.event, &ctx.partition, &ctx.offset, ctx.now_ms,
                                                                 py.None()))?;
            let touched = PyDict::new(py);
            for (id, record) in &ctx.touched {
                touched.set_item(id, record)?;
            }
            let children = PyDict::new(py);
            for child in &ctx.touched_children {
                children.set_item(child.as_ptr() as usize, child)?;
            }
            context.setattr("touched", touched)?;
            context.setattr("touched_children", children)?;
            self.env.raise_violation.bind(py).call1((parent, context, &ctx.view))?;
            return Err(PyValueError::new_err("fold._raise_violation found no violation the core found"));
        }
        Ok(())
    }

    fn holds(&self, parent: &Bound<'_, PyDict>) -> PyResult<bool> {
        let py = parent.py();
        let live = int(parent, intern!(py, "live_children"))?;
        if live < 0 || live > int(parent, intern!(py, "open_children"))? {
            return Ok(false);
        }
        let terms = [intern!(py, "capacity"), intern!(py, "available"), intern!(py, "outstanding"),
                     intern!(py, "pending"), intern!(py, "awaiting_confirmation"), intern!(py, "lent"),
                     intern!(py, "returned_to_pool"), intern!(py, "committed"), intern!(py, "overdrawn")];
        for (_, balance) in sub_dict(parent, intern!(py, "dimensions"))?.iter() {
            let balance = balance.downcast_into::<PyDict>()?;
            let mut values = [0i64; 9];
            if !terms_by_identity(&balance, &terms, &mut values) {
                for (slot, term) in values.iter_mut().zip(terms.iter()) {
                    *slot = int(&balance, term)?;
                }
            }
            let sum: i128 = values.iter().map(|v| *v as i128).sum();
            if values.iter().any(|v| *v < 0) || sum != 2 * (values[0] as i128 + values[8] as i128) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// The nine terms of `balance` in one pass over it, where each is found under its interned name itself (as the
/// records the fold makes and the codec decodes have them) and is an int within i64: true. False where any is not
/// (a term under an equal string of its own, a missing one, another kind of value): then read them by name.
fn terms_by_identity(balance: &Bound<'_, PyDict>, terms: &[&Bound<'_, PyString>; 9], values: &mut [i64; 9]) -> bool {
    let mut seen = 0u16;
    let mut at: pyo3::ffi::Py_ssize_t = 0;
    let mut key: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    let mut value: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    // SAFETY: PyDict_Next gives borrowed references, used before the next call; no Python code runs in this loop
    // (only exact ints are read, with PyLong_AsLongLongAndOverflow, which calls no __index__).
    while unsafe { pyo3::ffi::PyDict_Next(balance.as_ptr(), &mut at, &mut key, &mut value) } != 0 {
        let Some(slot) = terms.iter().position(|term| term.as_ptr() == key) else { continue };
        if unsafe { pyo3::ffi::PyLong_CheckExact(value) } == 0 {
            return false;
        }
        let mut overflow: std::os::raw::c_int = 0;
        let n = unsafe { pyo3::ffi::PyLong_AsLongLongAndOverflow(value, &mut overflow) };
        if overflow != 0 || (n == -1 && unsafe { !pyo3::ffi::PyErr_Occurred().is_null() }) {
            unsafe { pyo3::ffi::PyErr_Clear() };
            return false;
        }
        values[slot] = n;
        seen |= 1 << slot;
    }
    seen == 0x1FF
}

#[pyfunction]
#[pyo3(name = "murmur2")]
pub fn murmur2_py(data: &[u8]) -> u32 {
    murmur2(data)
}
