//! Finds a float that JSON cannot hold in a value about to be recorded.
//!
//! serde_json writes a NaN or infinite `f32`/`f64` as `null`, at any depth
//! and without an error, before any formatter sees it; a recorded outcome
//! would then replay as something else (`None` for `Some(f64::NAN)`, a
//! decode error for a bare `f64`). [`check`] walks the value through serde
//! once, writing nothing, and fails on the first such float.

use serde::Serialize;
use serde::ser::{self, Error as _};

/// Fails when `value` serializes a NaN or infinite float anywhere (a field,
/// an element, a map key or value, an enum's payload), with a serde_json
/// error that names it; `Ok` otherwise. Errors the value's own `Serialize`
/// raises are returned as they are.
pub(crate) fn check<T: Serialize + ?Sized>(value: &T) -> Result<(), serde_json::Error> {
    value.serialize(Finite)
}

/// A serializer that writes nothing and refuses non-finite floats.
struct Finite;

type Done = Result<(), serde_json::Error>;

fn float(value: f64) -> Done {
    if value.is_finite() {
        Ok(())
    } else {
        Err(serde_json::Error::custom(format!(
            "the float {value} has no JSON form (serde_json would write null)"
        )))
    }
}

impl ser::Serializer for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    type SerializeSeq = Finite;
    type SerializeTuple = Finite;
    type SerializeTupleStruct = Finite;
    type SerializeTupleVariant = Finite;
    type SerializeMap = Finite;
    type SerializeStruct = Finite;
    type SerializeStructVariant = Finite;

    fn serialize_bool(self, _: bool) -> Done {
        Ok(())
    }
    fn serialize_i8(self, _: i8) -> Done {
        Ok(())
    }
    fn serialize_i16(self, _: i16) -> Done {
        Ok(())
    }
    fn serialize_i32(self, _: i32) -> Done {
        Ok(())
    }
    fn serialize_i64(self, _: i64) -> Done {
        Ok(())
    }
    fn serialize_i128(self, _: i128) -> Done {
        Ok(())
    }
    fn serialize_u8(self, _: u8) -> Done {
        Ok(())
    }
    fn serialize_u16(self, _: u16) -> Done {
        Ok(())
    }
    fn serialize_u32(self, _: u32) -> Done {
        Ok(())
    }
    fn serialize_u64(self, _: u64) -> Done {
        Ok(())
    }
    fn serialize_u128(self, _: u128) -> Done {
        Ok(())
    }
    fn serialize_f32(self, v: f32) -> Done {
        float(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Done {
        float(v)
    }
    fn serialize_char(self, _: char) -> Done {
        Ok(())
    }
    fn serialize_str(self, _: &str) -> Done {
        Ok(())
    }
    fn serialize_bytes(self, _: &[u8]) -> Done {
        Ok(())
    }
    fn serialize_none(self) -> Done {
        Ok(())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn serialize_unit(self) -> Done {
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Done {
        Ok(())
    }
    fn serialize_unit_variant(self, _: &'static str, _: u32, _: &'static str) -> Done {
        Ok(())
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        value: &T,
    ) -> Done {
        value.serialize(Finite)
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Finite, serde_json::Error> {
        Ok(Finite)
    }
    fn serialize_tuple(self, _: usize) -> Result<Finite, serde_json::Error> {
        Ok(Finite)
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Finite, serde_json::Error> {
        Ok(Finite)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Finite, serde_json::Error> {
        Ok(Finite)
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Finite, serde_json::Error> {
        Ok(Finite)
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Finite, serde_json::Error> {
        Ok(Finite)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Finite, serde_json::Error> {
        Ok(Finite)
    }
    fn collect_str<T: std::fmt::Display + ?Sized>(self, _: &T) -> Done {
        Ok(())
    }
}

impl ser::SerializeSeq for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn end(self) -> Done {
        Ok(())
    }
}

impl ser::SerializeTuple for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn end(self) -> Done {
        Ok(())
    }
}

impl ser::SerializeTupleStruct for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn end(self) -> Done {
        Ok(())
    }
}

impl ser::SerializeTupleVariant for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn end(self) -> Done {
        Ok(())
    }
}

impl ser::SerializeMap for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Done {
        key.serialize(Finite)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn end(self) -> Done {
        Ok(())
    }
}

impl ser::SerializeStruct for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn end(self) -> Done {
        Ok(())
    }
}

impl ser::SerializeStructVariant for Finite {
    type Ok = ();
    type Error = serde_json::Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, _: &'static str, value: &T) -> Done {
        value.serialize(Finite)
    }
    fn end(self) -> Done {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::check;

    #[derive(serde::Serialize)]
    enum Reading {
        Level(f64),
        Pair(f32, f32),
        Named { value: Option<f64> },
    }

    #[derive(serde::Serialize)]
    struct Report {
        name: String,
        values: Vec<Option<f64>>,
        by_name: BTreeMap<String, f32>,
        reading: Reading,
    }

    fn report(value: f64) -> Report {
        Report {
            name: "probe".into(),
            values: vec![Some(1.5), None],
            by_name: BTreeMap::from([("a".to_string(), 2.0)]),
            reading: Reading::Named { value: Some(value) },
        }
    }

    #[test]
    fn finite_values_pass_at_any_depth() {
        check(&report(0.25)).unwrap();
        check(&(1u8, "x", [f64::MAX, f64::MIN_POSITIVE], ())).unwrap();
        check(&serde_json::json!({"a": [1, 2.5, null]})).unwrap();
    }

    #[test]
    fn a_non_finite_float_is_found_at_any_depth() {
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let err = check(&report(bad)).unwrap_err();
            assert!(err.to_string().contains("no JSON form"), "{err}");
            assert!(check(&bad).is_err());
            assert!(check(&Some(bad)).is_err());
            assert!(check(&vec![Some(1.0), Some(bad)]).is_err());
            assert!(check(&Reading::Level(bad)).is_err());
            let mut r = report(1.0);
            r.values.push(Some(bad));
            assert!(check(&r).is_err());
        }
        assert!(check(&Reading::Pair(1.0, f32::NAN)).is_err());
        let mut r = report(1.0);
        r.by_name.insert("b".into(), f32::INFINITY);
        assert!(check(&r).is_err());
    }
}
