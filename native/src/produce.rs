//! A checkpoint's records handed to the producer (processors/kafka/checkpoint.py, `_produce_all` and `_produce`),
//! compiled: the same `Producer.produce` calls, in the same order, without a Python frame per record.

use pyo3::exceptions::PyBufferError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

/// Produce `records` to partition `partition`: (logical topic, key, value) triples, each to `topics[logical]`;
/// or, with `topic` given, (key, value) pairs, each to `topic`. `report`: the indexes of the records produced with
/// `on_delivery` (ascending), or None for every record; with `last_of_each_topic`, the last record of each
/// topic the records go to (checkpoint._last_of_each_topic: found here, from the end). A full local queue
/// (BufferError) polls 50 ms and tries the same record again, as `_produce` does. Returns None, or (index, error)
/// for the record whose produce raised anything else: the caller says which record it was and raises the error.
#[pyfunction]
#[pyo3(signature = (producer, records, partition, report, on_delivery, topics=None, topic=None,
                    last_of_each_topic=false, direct=false))]
#[allow(clippy::too_many_arguments)]
pub fn produce_records<'py>(py: Python<'py>, producer: &Bound<'py, PyAny>, records: &Bound<'py, PyList>,
                            partition: &Bound<'py, PyAny>, report: Option<Vec<usize>>, on_delivery: &Bound<'py, PyAny>,
                            topics: Option<&Bound<'py, PyDict>>, topic: Option<&Bound<'py, PyAny>>,
                            last_of_each_topic: bool, direct: bool) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let produce = producer.getattr(intern!(py, "produce"))?;
    let report = if last_of_each_topic { Some(last_of_each(records)?) } else { report };
    let mut reported = report.as_deref().unwrap_or(&[]).iter().peekable();
    // The direct path (below): librdkafka's functions, the producer's handle, the partition as librdkafka takes it.
    let lib = if direct { LIBRDKAFKA.get().and_then(Option::as_ref) } else { None };
    let direct = match lib {
        Some(lib) => match (producer_handle(lib, producer), partition.extract::<i32>()) {
            (Some(rk), Ok(p)) => Some((lib, rk, p)),
            _ => None,
        },
        None => None,
    };
    let mut names: Vec<(Bound<'py, PyAny>, CString)> = Vec::new();
    'records: for (n, record) in records.iter().enumerate() {
        let record = record.downcast_into::<PyTuple>()?;
        let (target, key, value) = match topic {
            Some(topic) => (topic.clone(), record.get_item(0)?, record.get_item(1)?),
            None => {
                let topics = topics.expect("topics or topic");
                let logical = record.get_item(0)?;
                let Some(target) = topics.get_item(&logical)? else {
                    return Err(pyo3::exceptions::PyKeyError::new_err(logical.unbind()));
                };
                (target, record.get_item(1)?, record.get_item(2)?)
            }
        };
        let with_report = match &report {
            None => true,
            Some(_) => {
                while reported.next_if(|&&r| r < n).is_some() {}
                reported.next_if_eq(&&n).is_some()
            }
        };
        if let (false, Some((lib, rk, p))) = (with_report, direct) {
            if let Some(name) = topic_name(&mut names, &target)? {
                loop {
                    match produce_direct(lib, rk, name, p, &key, &value)? {
                        Some(0) => continue 'records,
                        Some(ERR_QUEUE_FULL) => {
                            producer.call_method1(intern!(py, "poll"), (0.05,))?;
                        }
                        // any other error, or a key or value that is not bytes: `produce` says what it is
                        _ => break,
                    }
                }
            }
        }
        loop {
            let outcome = if with_report {
                produce.call1((&target, &value, &key, partition, on_delivery))
            } else {
                produce.call1((&target, &value, &key, partition))
            };
            match outcome {
                Ok(_) => break,
                Err(err) if err.is_instance_of::<PyBufferError>(py) => {
                    // the local queue is full: let deliveries drain
                    producer.call_method1(intern!(py, "poll"), (0.05,))?;
                }
                Err(err) => {
                    let index = n.into_pyobject(py)?.into_any();
                    return Ok(Some(PyTuple::new(py, [index, err.into_value(py).into_bound(py).into_any()])?));
                }
            }
        }
    }
    Ok(None)
}

/// The indexes (ascending) of the last of `records` ((logical topic, key, value) triples) of each topic.
fn last_of_each(records: &Bound<'_, PyList>) -> PyResult<Vec<usize>> {
    let mut seen: Vec<Bound<'_, PyAny>> = Vec::new();
    let mut last = Vec::new();
    for n in (0..records.len()).rev() {
        let topic = records.get_item(n)?.downcast_into::<PyTuple>()?.get_item(0)?;
        let mut known = false;
        for other in &seen {
            if other.is(&topic) || other.eq(&topic)? {
                known = true;
                break;
            }
        }
        if !known {
            seen.push(topic);
            last.push(n);
        }
    }
    last.reverse();
    Ok(last)
}

// -- records handed to librdkafka directly -------------------------------------------------------------------------
//
// confluent-kafka's `Producer.produce` parses its arguments, allocates a per-message state for its delivery callback
// (for every message, a callback given or not), and librdkafka's delivery report of every message then takes the
// interpreter lock to free it. For the records produced without a delivery report (all but the last of each topic),
// the compiled loop can call librdkafka's `rd_kafka_produceva` itself, on the producer's own handle, with exactly
// what `produce` passes (topic by name, partition, key, value, copied; no timestamp, no headers), and no per-message
// state: confluent-kafka's delivery callback returns at once for a message without one. Used only where
// `direct_produce_open` found the librdkafka that confluent-kafka loaded, and on a producer that is confluent-kafka's
// own `Producer` (processors/kafka/direct_produce.py decides); any error but a full queue goes back to `produce`,
// which raises it as it always did.

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::OnceLock;

#[repr(C)]
#[derive(Clone, Copy)]
struct Mem {
    ptr: *const c_void,
    size: usize,
}

/// librdkafka's rd_kafka_vu_t: a tag, then a union padded to 64 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
union VuValue {
    cstr: *const c_char,
    int: c_int,
    i32: i32,
    mem: Mem,
    pad: [u8; 64],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Vu {
    vtype: c_int,
    u: VuValue,
}

const VTYPE_TOPIC: c_int = 1;
const VTYPE_PARTITION: c_int = 3;
const VTYPE_VALUE: c_int = 4;
const VTYPE_KEY: c_int = 5;
const VTYPE_MSGFLAGS: c_int = 7;
const MSG_F_COPY: c_int = 0x2;
const ERR_QUEUE_FULL: c_int = -184;
const RD_KAFKA_PRODUCER: c_int = 0;
const RTLD_NOW: c_int = 2;
const RTLD_NOLOAD: c_int = 4;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

type ProduceVa = unsafe extern "C" fn(*mut c_void, *const Vu, usize) -> *mut c_void;
type ErrorCode = unsafe extern "C" fn(*const c_void) -> c_int;
type ErrorDestroy = unsafe extern "C" fn(*mut c_void);
type Kind = unsafe extern "C" fn(*const c_void) -> c_int;
type Opaque = unsafe extern "C" fn(*const c_void) -> *mut c_void;

struct Librdkafka {
    produceva: ProduceVa,
    error_code: ErrorCode,
    error_destroy: ErrorDestroy,
    kind: Kind,
    opaque: Opaque,
}

// Function pointers into a library loaded for the life of the process.
unsafe impl Send for Librdkafka {}
unsafe impl Sync for Librdkafka {}

static LIBRDKAFKA: OnceLock<Option<Librdkafka>> = OnceLock::new();

/// Records handed to librdkafka directly since the process started (what the tests check the path by).
static DIRECT_RECORDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many records this process handed to librdkafka directly.
#[pyfunction]
pub fn direct_produce_count() -> u64 {
    DIRECT_RECORDS.load(std::sync::atomic::Ordering::Relaxed)
}

fn symbol(handle: *mut c_void, name: &str) -> Option<*mut c_void> {
    let name = CString::new(name).ok()?;
    let found = unsafe { dlsym(handle, name.as_ptr()) };
    (!found.is_null()).then_some(found)
}

fn open_librdkafka(path: &str) -> Option<Librdkafka> {
    let path = CString::new(path).ok()?;
    // RTLD_NOLOAD: only the library already loaded (confluent-kafka's), never a second copy.
    let handle = unsafe { dlopen(path.as_ptr(), RTLD_NOW | RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    unsafe {
        Some(Librdkafka {
            produceva: std::mem::transmute::<*mut c_void, ProduceVa>(symbol(handle, "rd_kafka_produceva")?),
            error_code: std::mem::transmute::<*mut c_void, ErrorCode>(symbol(handle, "rd_kafka_error_code")?),
            error_destroy: std::mem::transmute::<*mut c_void, ErrorDestroy>(symbol(handle, "rd_kafka_error_destroy")?),
            kind: std::mem::transmute::<*mut c_void, Kind>(symbol(handle, "rd_kafka_type")?),
            opaque: std::mem::transmute::<*mut c_void, Opaque>(symbol(handle, "rd_kafka_opaque")?),
        })
    }
}

/// Find the librdkafka loaded from `path` (the one confluent-kafka uses) and its functions; whether they were found.
/// The first call decides for the life of the process.
#[pyfunction]
pub fn direct_produce_open(path: &str) -> bool {
    LIBRDKAFKA.get_or_init(|| open_librdkafka(path)).is_some()
}

/// The librdkafka handle of `producer`, a confluent-kafka `Producer` (its object starts with the handle, right after the
/// object header), where it is a producer handle whose opaque is `producer` itself (confluent-kafka makes each handle
/// with its object as the opaque its callbacks get); else None (a closed producer has none).
fn producer_handle(lib: &Librdkafka, producer: &Bound<'_, PyAny>) -> Option<*mut c_void> {
    let rk = unsafe {
        *(producer.as_ptr() as *const u8).add(std::mem::size_of::<pyo3::ffi::PyObject>()).cast::<*mut c_void>()
    };
    let ours = !rk.is_null()
        && unsafe { (lib.kind)(rk) } == RD_KAFKA_PRODUCER
        && std::ptr::eq(unsafe { (lib.opaque)(rk) }.cast_const(), producer.as_ptr().cast());
    ours.then_some(rk)
}

/// Hand one record to librdkafka: the error code (0: queued), or None for a key or a value that is neither bytes nor
/// None (`produce` takes text too, and says what it takes).
fn produce_direct(lib: &Librdkafka, rk: *mut c_void, topic: &CString, partition: i32, key: &Bound<'_, PyAny>,
                  value: &Bound<'_, PyAny>) -> PyResult<Option<c_int>> {
    fn mem(data: &Bound<'_, PyAny>) -> Option<Mem> {
        if data.is_none() {
            return Some(Mem { ptr: std::ptr::null(), size: 0 });
        }
        let bytes = data.downcast::<PyBytes>().ok()?.as_bytes();
        Some(Mem { ptr: bytes.as_ptr().cast(), size: bytes.len() })
    }
    let (Some(key), Some(value)) = (mem(key), mem(value)) else {
        return Ok(None);
    };
    let vus = [
        Vu { vtype: VTYPE_MSGFLAGS, u: VuValue { int: MSG_F_COPY } },
        Vu { vtype: VTYPE_TOPIC, u: VuValue { cstr: topic.as_ptr() } },
        Vu { vtype: VTYPE_PARTITION, u: VuValue { i32: partition } },
        Vu { vtype: VTYPE_KEY, u: VuValue { mem: key } },
        Vu { vtype: VTYPE_VALUE, u: VuValue { mem: value } },
    ];
    // The key and the value are copied before this returns (RD_KAFKA_MSG_F_COPY), while the records hold them.
    let error = unsafe { (lib.produceva)(rk, vus.as_ptr(), vus.len()) };
    if error.is_null() {
        DIRECT_RECORDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return Ok(Some(0));
    }
    let code = unsafe { (lib.error_code)(error) };
    unsafe { (lib.error_destroy)(error) };
    Ok(Some(code))
}

/// `target`'s name as librdkafka takes it, made once per call of produce_records; None for a name that is not text
/// without NULs (`produce` says what is wrong with it).
fn topic_name<'a, 'py>(names: &'a mut Vec<(Bound<'py, PyAny>, CString)>, target: &Bound<'py, PyAny>)
                       -> PyResult<Option<&'a CString>> {
    if let Some(index) = names.iter().position(|(object, _)| object.is(target)) {
        return Ok(Some(&names[index].1));
    }
    let Ok(text) = target.downcast::<PyString>() else { return Ok(None) };
    let Ok(name) = CString::new(text.to_str()?) else { return Ok(None) };
    names.push((target.clone(), name));
    Ok(names.last().map(|(_, name)| name))
}
