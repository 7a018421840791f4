//! The compiled hot path of branch-settlement: Avro binary readers and writers of its records, behind the
//! interface of the generated Python ones (schemas/codegen.py), and the idempotency digest of its events, behind
//! that of the generated sorted-JSON writers (schemas/event_json.py). The Python stays the reference.
//!
//! A schema arrives as a *plan* built in Python (`codegen._plan`, `event_json.sorted_json_plan`): nested tuples
//! whose first item is the kind.
//! What the plan says is exactly what the generated Python code does, and this module decides nothing of its
//! own: a writer takes only plain values and raises NotPlain on anything else, so that `Codec` hands the record
//! to fastavro; a reader takes only the canonical encodings the Python reader takes and raises NotPlain on
//! anything else, and CodecError (with the same message) for a varint beyond 64 bits.
//! tests/ledger/test_implementations_agree.py holds them to the Python ones, byte for byte and error for error.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple, PyType};

mod batch;
mod fold;
mod outputs;
mod produce;
mod stats;
mod store;

// Plan kinds, as codegen.py numbers them.
const NULL: u8 = 0;
const BOOLEAN: u8 = 1;
const LONG: u8 = 2;
const STRING: u8 = 3;
const BYTES: u8 = 4;
const RECORD: u8 = 5;
const MAP: u8 = 6;
const ARRAY: u8 = 7;
const UNION: u8 = 8;

enum Node {
    Null,
    Boolean,
    Long,
    Str,
    Bytes,
    Record { keys: Vec<Py<PyString>>, fields: Vec<Node> },
    Map(Box<Node>),
    Array(Box<Node>),
    Union(Vec<Node>),
}

fn build(plan: &Bound<'_, PyAny>) -> PyResult<Node> {
    let plan = plan.downcast::<PyTuple>()?;
    let kind: u8 = plan.get_item(0)?.extract()?;
    Ok(match kind {
        NULL => Node::Null,
        BOOLEAN => Node::Boolean,
        LONG => Node::Long,
        STRING => Node::Str,
        BYTES => Node::Bytes,
        RECORD => {
            let py = plan.py();
            let names = plan.get_item(1)?;
            let mut keys = Vec::new();
            for name in names.try_iter()? {
                let name: String = name?.extract()?;
                keys.push(PyString::intern(py, &name).unbind());
            }
            let mut fields = Vec::new();
            for field in plan.get_item(2)?.try_iter()? {
                fields.push(build(&field?)?);
            }
            if keys.len() != fields.len() {
                return Err(PyValueError::new_err("a record plan needs one plan per field"));
            }
            Node::Record { keys, fields }
        }
        MAP => Node::Map(Box::new(build(&plan.get_item(1)?)?)),
        ARRAY => Node::Array(Box::new(build(&plan.get_item(1)?)?)),
        UNION => {
            let mut branches = Vec::new();
            for branch in plan.get_item(1)?.try_iter()? {
                branches.push(build(&branch?)?);
            }
            if branches.is_empty() || branches.len() > 64 {
                return Err(PyValueError::new_err("a union plan needs 1 to 64 branches"));
            }
            Node::Union(branches)
        }
        other => return Err(PyValueError::new_err(format!("unknown plan kind {other}"))),
    })
}

// ---- strings ------------------------------------------------------------------------------------------------

/// The str of `text`, as `PyString::new` makes it, without CPython decoding again what is ASCII already: where it
/// is, a compact ASCII str of its length (`PyUnicode_New`, the object `PyUnicode_FromStringAndSize` makes of ASCII
/// bytes) with the bytes copied in. Most of the records' strings are ids and names, all ASCII.
pub(crate) fn new_str<'py>(py: Python<'py>, text: &str) -> Bound<'py, PyString> {
    if text.is_ascii() {
        ascii_str(py, text.as_bytes())
    } else {
        PyString::new(py, text)
    }
}

/// `data`, which is ASCII, as a str (new_str).
fn ascii_str<'py>(py: Python<'py>, data: &[u8]) -> Bound<'py, PyString> {
    debug_assert!(data.is_ascii());
    // SAFETY: PyUnicode_New(n, 127) gives a new compact ASCII str of n one-byte characters, its terminating NUL
    // written, or NULL with an exception set (from_owned_ptr then panics, as PyString::new does); its data holds
    // n bytes, and ASCII bytes are valid characters of that kind. Nothing else holds it before the copy.
    unsafe {
        let object = pyo3::ffi::PyUnicode_New(data.len() as pyo3::ffi::Py_ssize_t, 127);
        if !object.is_null() {
            std::ptr::copy_nonoverlapping(data.as_ptr(), pyo3::ffi::PyUnicode_1BYTE_DATA(object), data.len());
        }
        Bound::from_owned_ptr(py, object).downcast_into_unchecked()
    }
}

// ---- writing ------------------------------------------------------------------------------------------------

/// Anything a writer does not take: the caller raises NotPlain.
pub(crate) struct NotPlain;

#[inline]
fn put_long(out: &mut Vec<u8>, value: i64) {
    let mut n = ((value << 1) ^ (value >> 63)) as u64;
    while n > 0x7F {
        out.push((n as u8 & 0x7F) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn write(node: &Node, value: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Result<(), NotPlain> {
    match node {
        Node::Long => {
            let int = value.downcast_exact::<PyInt>().map_err(|_| NotPlain)?;
            put_long(out, int.extract::<i64>().map_err(|_| NotPlain)?);
        }
        Node::Str => {
            let text = value.downcast_exact::<PyString>().map_err(|_| NotPlain)?;
            let text = text.to_str().map_err(|_| NotPlain)?; // a lone surrogate has no UTF-8
            put_long(out, text.len() as i64);
            out.extend_from_slice(text.as_bytes());
        }
        Node::Bytes => {
            let data = value.downcast_exact::<PyBytes>().map_err(|_| NotPlain)?.as_bytes();
            put_long(out, data.len() as i64);
            out.extend_from_slice(data);
        }
        Node::Boolean => {
            let flag = value.downcast_exact::<PyBool>().map_err(|_| NotPlain)?;
            out.push(flag.is_true() as u8);
        }
        Node::Null => {
            if !value.is_none() {
                return Err(NotPlain);
            }
        }
        Node::Record { keys, fields } => {
            let record = value.downcast_exact::<PyDict>().map_err(|_| NotPlain)?;
            let py = value.py();
            for (key, field) in keys.iter().zip(fields) {
                let item = record.get_item(key.bind(py)).map_err(|_| NotPlain)?.ok_or(NotPlain)?;
                write(field, &item, out)?;
            }
        }
        Node::Map(values) => {
            let map = value.downcast_exact::<PyDict>().map_err(|_| NotPlain)?;
            let size = map.len();
            if size > 0 {
                put_long(out, size as i64);
                // PyDict_Next rather than PyO3's iterator, which panics (an abort, here) if the map changes size
                // under it; a lookup of an odd key in a nested record can run Python code that changes it. The
                // generated Python raises then (RuntimeError), so this gives up alike: NotPlain.
                let py = value.py();
                let mut at: pyo3::ffi::Py_ssize_t = 0;
                let mut key: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
                let mut item: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
                // SAFETY: `map` is a dict held by `value`; PyDict_Next gives borrowed references, owned at once.
                while unsafe { pyo3::ffi::PyDict_Next(map.as_ptr(), &mut at, &mut key, &mut item) } != 0 {
                    let (key, item) = unsafe { (Bound::from_borrowed_ptr(py, key), Bound::from_borrowed_ptr(py, item)) };
                    write(&Node::Str, &key, out)?;
                    write(values, &item, out)?;
                    if map.len() != size {
                        return Err(NotPlain);
                    }
                }
            }
            out.push(0);
        }
        Node::Array(items) => {
            let list = value.downcast_exact::<PyList>().map_err(|_| NotPlain)?;
            if !list.is_empty() {
                put_long(out, list.len() as i64);
                for item in list.iter() {
                    write(items, &item, out)?;
                }
            }
            out.push(0);
        }
        Node::Union(branches) => {
            // A writer's union is [null, T] or [T, null] (codegen.plan refuses any other).
            let null_index = branches.iter().position(|b| matches!(b, Node::Null)).ok_or(NotPlain)?;
            if value.is_none() {
                out.push((null_index as u8) << 1);
            } else {
                let index = 1 - null_index;
                out.push((index as u8) << 1);
                write(&branches[index], value, out)?;
            }
        }
    }
    Ok(())
}

/// A writer's unions are [null, T] or [T, null] with T not null (codegen._plan refuses others): `write`
/// relies on it.
fn check_writable(node: &Node) -> PyResult<()> {
    match node {
        Node::Record { fields, .. } => fields.iter().try_for_each(check_writable),
        Node::Map(inner) | Node::Array(inner) => check_writable(inner),
        Node::Union(branches) => {
            let nulls = branches.iter().filter(|b| matches!(b, Node::Null)).count();
            if branches.len() != 2 || nulls != 1 {
                return Err(PyValueError::new_err("a writer's union plan is null and one other type"));
            }
            branches.iter().try_for_each(check_writable)
        }
        _ => Ok(()),
    }
}

/// `header` + the Avro binary encoding of a plain record, as codegen.compile_encoder's generated function.
#[pyclass(frozen, module = "branch_settlement_native")]
struct Encoder {
    header: Vec<u8>,
    root: Node,
    not_plain: Py<PyType>,
}

#[pymethods]
impl Encoder {
    #[new]
    fn new(plan: &Bound<'_, PyAny>, header: Vec<u8>, not_plain: Bound<'_, PyType>) -> PyResult<Self> {
        let root = build(plan)?;
        check_writable(&root)?;
        Ok(Encoder { header, root, not_plain: not_plain.unbind() })
    }

    fn __call__<'py>(&self, py: Python<'py>, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        self.encode_with(py, value, &mut Vec::with_capacity(256))
            .map_err(|NotPlain| PyErr::from_type(self.not_plain.bind(py).clone(), ()))
    }
}

impl Encoder {
    /// `header` + the encoding of a plain record, written in `buffer` (cleared first, so that a caller encoding
    /// many records reuses it) and returned as bytes; NotPlain for what only fastavro encodes.
    pub(crate) fn encode_with<'py>(&self, py: Python<'py>, value: &Bound<'py, PyAny>, buffer: &mut Vec<u8>)
                                   -> Result<Bound<'py, PyBytes>, NotPlain> {
        buffer.clear();
        buffer.extend_from_slice(&self.header);
        write(&self.root, value, buffer)?;
        Ok(PyBytes::new(py, buffer))
    }

    /// For a record written from values the caller holds in slots (`slots`: their names) rather than from a dict:
    /// the slot of each of the record's fields, in the schema's order. None where the root is not a record, a field
    /// has no slot, or there are more fields than a `SlotOrder` holds.
    pub(crate) fn slot_order(&self, py: Python<'_>, slots: &[&str]) -> Option<SlotOrder> {
        let Node::Record { keys, .. } = &self.root else { return None };
        let mut order = SlotOrder { len: keys.len(), slots: [0; SlotOrder::MAX] };
        if keys.len() > SlotOrder::MAX {
            return None;
        }
        for (field, key) in keys.iter().enumerate() {
            let name = key.bind(py).to_str().ok()?;
            order.slots[field] = slots.iter().position(|slot| *slot == name)? as u8;
        }
        Some(order)
    }

    /// `header` + the encoding of the record whose field values are `values`, placed by `order` (`slot_order`):
    /// the bytes `encode_with` writes for a dict of those values, without the dict. NotPlain as there.
    pub(crate) fn encode_slots<'py>(&self, py: Python<'py>, order: &SlotOrder, values: &[Bound<'py, PyAny>],
                                    buffer: &mut Vec<u8>) -> Result<Bound<'py, PyBytes>, NotPlain> {
        let Node::Record { fields, .. } = &self.root else { return Err(NotPlain) };
        buffer.clear();
        buffer.extend_from_slice(&self.header);
        for (field, slot) in fields.iter().zip(&order.slots[..order.len]) {
            write(field, values.get(*slot as usize).ok_or(NotPlain)?, buffer)?;
        }
        Ok(PyBytes::new(py, buffer))
    }
}

/// Where each field of a record's schema finds its value among a writer's slots (Encoder::slot_order).
#[derive(Clone, Copy)]
pub(crate) struct SlotOrder {
    len: usize,
    slots: [u8; SlotOrder::MAX],
}

impl SlotOrder {
    const MAX: usize = 32;
}

// ---- reading ------------------------------------------------------------------------------------------------

enum ReadError {
    /// Bytes the reader leaves to fastavro (the caller raises NotPlain).
    NotPlain,
    /// A varint beyond the 64 bits of a long, ending at this position: CodecError.
    Overflow(usize),
    Python(PyErr),
}

impl From<PyErr> for ReadError {
    fn from(err: PyErr) -> Self {
        ReadError::Python(err)
    }
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    fn byte(&mut self) -> Result<u8, ReadError> {
        let b = *self.data.get(self.pos).ok_or(ReadError::NotPlain)?;
        self.pos += 1;
        Ok(b)
    }

    /// The rest of a varint whose first byte `first` had its continuation bit set, as codegen._read_varint:
    /// any number of bytes, refused only if a bit beyond the 64th is set.
    fn varint_tail(&mut self, first: u8) -> Result<i64, ReadError> {
        let mut n: u64 = (first & 0x7F) as u64;
        let mut shift: u32 = 7;
        let mut overflow = false;
        loop {
            let b = self.byte()?;
            let payload = (b & 0x7F) as u64;
            if payload != 0 {
                if shift >= 64 || (shift > 57 && payload >> (64 - shift) != 0) {
                    overflow = true;
                } else {
                    n |= payload << shift;
                }
            }
            shift = shift.saturating_add(7);
            if b < 0x80 {
                break;
            }
        }
        if overflow {
            return Err(ReadError::Overflow(self.pos));
        }
        Ok(((n >> 1) as i64) ^ -((n & 1) as i64))
    }

    #[inline]
    fn long(&mut self) -> Result<i64, ReadError> {
        let b = self.byte()?;
        if b < 0x80 {
            Ok(((b >> 1) as i64) ^ -((b & 1) as i64))
        } else {
            self.varint_tail(b)
        }
    }

    /// A length or block count: negative ones (sized blocks) are left to fastavro.
    #[inline]
    fn length(&mut self) -> Result<usize, ReadError> {
        let b = self.byte()?;
        if b & 0x81 == 0 {
            return Ok((b >> 1) as usize);
        }
        if b < 0x80 {
            return Err(ReadError::NotPlain);
        }
        let n = self.varint_tail(b)?;
        if n < 0 {
            return Err(ReadError::NotPlain);
        }
        Ok(n as usize)
    }

    #[inline]
    fn slice(&mut self) -> Result<&'a [u8], ReadError> {
        let n = self.length()?;
        let end = self.pos.checked_add(n).ok_or(ReadError::NotPlain)?;
        let data = self.data.get(self.pos..end).ok_or(ReadError::NotPlain)?;
        self.pos = end;
        Ok(data)
    }

    fn string<'py>(&mut self, py: Python<'py>) -> Result<Bound<'py, PyString>, ReadError> {
        let data = self.slice()?;
        if data.is_ascii() {
            return Ok(ascii_str(py, data));
        }
        let text = std::str::from_utf8(data).map_err(|_| ReadError::NotPlain)?;
        Ok(PyString::new(py, text))
    }

    fn read<'py>(&mut self, py: Python<'py>, node: &Node) -> Result<Bound<'py, PyAny>, ReadError> {
        Ok(match node {
            Node::Long => self.long()?.into_pyobject(py).unwrap_or_else(|never| match never {}).into_any(),
            Node::Str => self.string(py)?.into_any(),
            Node::Bytes => PyBytes::new(py, self.slice()?).into_any(),
            Node::Boolean => PyBool::new(py, self.byte()? != 0).to_owned().into_any(),
            Node::Null => py.None().into_bound(py),
            Node::Record { keys, fields } => {
                let record = PyDict::new(py);
                self.fields(py, &record, keys, fields)?;
                record.into_any()
            }
            Node::Map(values) => {
                let map = PyDict::new(py);
                let mut count = self.length()?;
                while count > 0 {
                    for _ in 0..count {
                        let key = self.string(py)?;
                        let item = self.read(py, values)?;
                        map.set_item(key, item)?;
                    }
                    count = self.length()?;
                }
                map.into_any()
            }
            Node::Array(items) => {
                let list = PyList::empty(py);
                let mut count = self.length()?;
                while count > 0 {
                    for _ in 0..count {
                        list.append(self.read(py, items)?)?;
                    }
                    count = self.length()?;
                }
                list.into_any()
            }
            Node::Union(branches) => {
                let b = self.byte()?;
                let index = (b >> 1) as usize;
                if b & 1 != 0 || index >= branches.len() {
                    return Err(ReadError::NotPlain);
                }
                self.read(py, &branches[index])?
            }
        })
    }

    fn fields<'py>(&mut self, py: Python<'py>, record: &Bound<'py, PyDict>, keys: &[Py<PyString>],
                   fields: &[Node]) -> Result<(), ReadError> {
        for (key, field) in keys.iter().zip(fields) {
            let value = self.read(py, field)?;
            record.set_item(key.bind(py), value)?;
        }
        Ok(())
    }
}

/// The record of single-object encoded bytes written with the current schema, with `head`'s items first, as
/// codegen.compile_decoder's generated function (the first `header_size` bytes are not checked).
#[pyclass(frozen, module = "branch_settlement_native")]
struct Decoder {
    header_size: usize,
    head: Vec<(Py<PyString>, Py<PyAny>)>,
    keys: Vec<Py<PyString>>,
    fields: Vec<Node>,
    not_plain: Py<PyType>,
    codec_error: Py<PyType>,
}

#[pymethods]
impl Decoder {
    #[new]
    fn new(plan: &Bound<'_, PyAny>, header_size: usize, head: &Bound<'_, PyDict>, not_plain: Bound<'_, PyType>,
           codec_error: Bound<'_, PyType>) -> PyResult<Self> {
        let py = plan.py();
        let (keys, fields) = match build(plan)? {
            Node::Record { keys, fields } => (keys, fields),
            _ => return Err(PyValueError::new_err("a reader's plan is a record")),
        };
        let mut items = Vec::new();
        for (key, value) in head.iter() {
            let key: String = key.extract()?;
            items.push((PyString::intern(py, &key).unbind(), value.unbind()));
        }
        Ok(Decoder { header_size, head: items, keys, fields, not_plain: not_plain.unbind(),
                     codec_error: codec_error.unbind() })
    }

    fn __call__<'py>(&self, py: Python<'py>, data: &Bound<'py, PyBytes>) -> PyResult<Bound<'py, PyDict>> {
        // sized for every field at once: no table grows (and rehashes) as the fields are set
        let record = crate::fold::presized(py, (self.head.len() + self.keys.len()) as isize)?;
        for (key, value) in &self.head {
            record.set_item(key.bind(py), value.bind(py))?;
        }
        let bytes = data.as_bytes();
        let mut reader = Reader { data: bytes, pos: self.header_size };
        let outcome = reader.fields(py, &record, &self.keys, &self.fields).and_then(|()| {
            if reader.pos == bytes.len() { Ok(()) } else { Err(ReadError::NotPlain) }
        });
        match outcome {
            Ok(()) => Ok(record),
            Err(ReadError::NotPlain) => Err(PyErr::from_type(self.not_plain.bind(py).clone(), ())),
            Err(ReadError::Overflow(pos)) => Err(PyErr::from_type(
                self.codec_error.bind(py).clone(),
                format!("a varint at byte {pos} is beyond the 64 bits of an Avro long"),
            )),
            Err(ReadError::Python(err)) => Err(err),
        }
    }
}

// ---- the idempotency digest ------------------------------------------------------------------------------

/// A JSON plan (schemas/event_json.py, sorted_json_plan): what the generated sorted-JSON writer checks and writes.
enum Json {
    Null,
    Boolean,
    Int,
    Str,
    Record { keys: Vec<Py<PyString>>, names: Vec<String>, fields: Vec<Json> },
    Map(Box<Json>),
    Array(Box<Json>),
    Nullable(Box<Json>),
}

fn build_json(plan: &Bound<'_, PyAny>) -> PyResult<Json> {
    let plan = plan.downcast::<PyTuple>()?;
    let kind: u8 = plan.get_item(0)?.extract()?;
    Ok(match kind {
        NULL => Json::Null,
        BOOLEAN => Json::Boolean,
        LONG => Json::Int,
        STRING => Json::Str,
        RECORD => {
            let py = plan.py();
            let names: Vec<String> = plan.get_item(1)?.extract()?;
            let keys = names.iter().map(|name| PyString::intern(py, name).unbind()).collect();
            let mut fields = Vec::new();
            for field in plan.get_item(2)?.try_iter()? {
                fields.push(build_json(&field?)?);
            }
            if names.len() != fields.len() {
                return Err(PyValueError::new_err("a record plan needs one plan per field"));
            }
            Json::Record { keys, names, fields }
        }
        MAP => Json::Map(Box::new(build_json(&plan.get_item(1)?)?)),
        ARRAY => Json::Array(Box::new(build_json(&plan.get_item(1)?)?)),
        UNION => Json::Nullable(Box::new(build_json(&plan.get_item(1)?)?)),
        other => return Err(PyValueError::new_err(format!("unknown JSON plan kind {other}"))),
    })
}

/// Anything the generated writer is not sure of: json.dumps decides (the caller digests its text).
struct NotSure;

/// A string as the generated writer takes it: exact str, valid UTF-8, nothing json.dumps would escape.
fn json_str<'a>(value: &'a Bound<'_, PyAny>) -> Result<&'a str, NotSure> {
    let text = value.downcast_exact::<PyString>().map_err(|_| NotSure)?.to_str().map_err(|_| NotSure)?;
    if text.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        return Err(NotSure);
    }
    Ok(text)
}

/// `n` in decimal, as Python's str() writes it (no allocation, no formatting machinery).
fn write_decimal(n: i64, out: &mut Vec<u8>) {
    let mut digits = [0u8; 20];
    let mut rest = n.unsigned_abs();
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    if n < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&digits[at..]);
}

fn write_json(node: &Json, value: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> Result<(), NotSure> {
    match node {
        Json::Null => {
            if !value.is_none() {
                return Err(NotSure);
            }
            out.extend_from_slice(b"null");
        }
        Json::Boolean => {
            let flag = value.downcast_exact::<PyBool>().map_err(|_| NotSure)?;
            out.extend_from_slice(if flag.is_true() { b"true" } else { b"false" });
        }
        Json::Int => {
            let int = value.downcast_exact::<PyInt>().map_err(|_| NotSure)?;
            match int.extract::<i64>() {
                Ok(n) => write_decimal(n, out),
                // beyond 64 bits: Python's own decimal text, as the f-string writes it
                Err(_) => out.extend_from_slice(int.str().map_err(|_| NotSure)?.to_str().map_err(|_| NotSure)?.as_bytes()),
            }
        }
        Json::Str => {
            out.push(b'"');
            out.extend_from_slice(json_str(value)?.as_bytes());
            out.push(b'"');
        }
        Json::Record { keys, names, fields } => {
            let record = value.downcast_exact::<PyDict>().map_err(|_| NotSure)?;
            if record.len() != fields.len() {
                return Err(NotSure);
            }
            let py = value.py();
            out.push(b'{');
            for (index, ((key, name), field)) in keys.iter().zip(names).zip(fields).enumerate() {
                let item = record.get_item(key.bind(py)).map_err(|_| NotSure)?.ok_or(NotSure)?;
                if index > 0 {
                    out.push(b',');
                }
                out.push(b'"');
                out.extend_from_slice(name.as_bytes());
                out.extend_from_slice(b"\":");
                write_json(field, &item, out)?;
            }
            out.push(b'}');
        }
        Json::Map(values) => {
            let map = value.downcast_exact::<PyDict>().map_err(|_| NotSure)?;
            let mut items = Vec::with_capacity(map.len());
            let py = value.py();
            let mut at: pyo3::ffi::Py_ssize_t = 0;
            let mut key: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
            let mut item: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
            // SAFETY: as in `write`: borrowed references from PyDict_Next, owned at once; no Python code runs here.
            while unsafe { pyo3::ffi::PyDict_Next(map.as_ptr(), &mut at, &mut key, &mut item) } != 0 {
                items.push(unsafe { (Bound::from_borrowed_ptr(py, key), Bound::from_borrowed_ptr(py, item)) });
            }
            let mut keyed = Vec::with_capacity(items.len());
            for (key, item) in &items {
                // any key not an exact str (or one json.dumps would escape): not sure
                keyed.push((json_str(key)?, item));
            }
            keyed.sort_unstable_by(|a, b| a.0.cmp(b.0)); // str keys are unique: code point order, as sorted()
            out.push(b'{');
            for (index, (key, item)) in keyed.into_iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                out.push(b'"');
                out.extend_from_slice(key.as_bytes());
                out.extend_from_slice(b"\":");
                write_json(values, item, out)?;
            }
            out.push(b'}');
        }
        Json::Array(items) => {
            let list = value.downcast_exact::<PyList>().map_err(|_| NotSure)?;
            out.push(b'[');
            for (index, item) in list.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_json(items, &item, out)?;
            }
            out.push(b']');
        }
        Json::Nullable(inner) => {
            if value.is_none() {
                out.extend_from_slice(b"null");
            } else {
                write_json(inner, value, out)?;
            }
        }
    }
    Ok(())
}

/// The idempotency digest of an event of one type (processors/ledger/fold.py, payload_digest): BLAKE2b-128 of the
/// text schemas/event_json.py's generated sorted-JSON writer gives, or None where that writer is not sure.
#[pyclass(frozen, module = "branch_settlement_native")]
pub(crate) struct SortedJsonDigest {
    count: usize,
    left_out: Vec<Py<PyString>>,
    record: Json,
}

impl SortedJsonDigest {
    pub(crate) fn digest<'py>(&self, py: Python<'py>, event: &Bound<'py, PyAny>) -> Option<Bound<'py, PyBytes>> {
        let text = self.text(event).ok()?;
        // BLAKE2b with a 16-byte digest (hashlib.blake2b(digest_size=16)), AVX2 where the CPU has it
        Some(PyBytes::new(py, blake2b_simd::Params::new().hash_length(16).hash(&text).as_bytes()))
    }

    fn text(&self, event: &Bound<'_, PyAny>) -> Result<Vec<u8>, NotSure> {
        let dict = event.downcast_exact::<PyDict>().map_err(|_| NotSure)?;
        if dict.len() != self.count {
            return Err(NotSure);
        }
        let py = event.py();
        for key in &self.left_out {
            if !dict.contains(key.bind(py)).map_err(|_| NotSure)? {
                return Err(NotSure);
            }
        }
        let mut out = Vec::with_capacity(256);
        // the kept keys are a record of their own: same checks but the count (the event has the left-out keys too)
        if let Json::Record { keys, names, fields } = &self.record {
            out.push(b'{');
            for (index, ((key, name), field)) in keys.iter().zip(names).zip(fields).enumerate() {
                let item = dict.get_item(key.bind(py)).map_err(|_| NotSure)?.ok_or(NotSure)?;
                if index > 0 {
                    out.push(b',');
                }
                out.push(b'"');
                out.extend_from_slice(name.as_bytes());
                out.extend_from_slice(b"\":");
                write_json(field, &item, &mut out)?;
            }
            out.push(b'}');
        }
        Ok(out)
    }
}

#[pymethods]
impl SortedJsonDigest {
    #[new]
    fn new(plan: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let py = plan.py();
        let count: usize = plan.get_item(0)?.extract()?;
        let left_out: Vec<String> = plan.get_item(1)?.extract()?;
        let kept: Vec<String> = plan.get_item(2)?.extract()?;
        let mut fields = Vec::new();
        for field in plan.get_item(3)?.try_iter()? {
            fields.push(build_json(&field?)?);
        }
        if kept.len() != fields.len() {
            return Err(PyValueError::new_err("a digest plan needs one plan per kept key"));
        }
        let keys = kept.iter().map(|name| PyString::intern(py, name).unbind()).collect();
        Ok(SortedJsonDigest {
            count,
            left_out: left_out.iter().map(|name| PyString::intern(py, name).unbind()).collect(),
            record: Json::Record { keys, names: kept, fields },
        })
    }

    /// The digest, or None where json.dumps decides.
    fn __call__<'py>(&self, py: Python<'py>, event: &Bound<'py, PyAny>) -> Option<Bound<'py, PyBytes>> {
        self.digest(py, event)
    }

    /// The text digested, or None (for the tests: the generated writer's text, byte for byte).
    fn sorted_json<'py>(&self, py: Python<'py>, event: &Bound<'py, PyAny>) -> Option<Bound<'py, PyBytes>> {
        self.text(event).ok().map(|text| PyBytes::new(py, &text))
    }
}

#[pymodule]
fn branch_settlement_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Encoder>()?;
    m.add_class::<Decoder>()?;
    m.add_class::<SortedJsonDigest>()?;
    m.add_class::<fold::FoldCore>()?;
    m.add_class::<outputs::OutputEncoder>()?;
    m.add_class::<batch::MessageFolder>()?;
    m.add_function(wrap_pyfunction!(produce::produce_records, m)?)?;
    m.add_function(wrap_pyfunction!(produce::direct_produce_open, m)?)?;
    m.add_function(wrap_pyfunction!(produce::direct_produce_count, m)?)?;
    m.add_function(wrap_pyfunction!(store::fill_batch, m)?)?;
    m.add_function(wrap_pyfunction!(stats::apply_ledger_changes, m)?)?;
    m.add_function(wrap_pyfunction!(stats::count_audits, m)?)?;
    m.add_function(wrap_pyfunction!(fold::murmur2_py, m)?)?;
    m.add("PLAN_VERSION", 5)?;
    Ok(())
}
