//! A borrowing msgpack reader: one value head at a time over a byte slice,
//! strings and binaries as sub-slices of the input, nothing allocated. The
//! marker table is rmp's; lengths are checked against what is left, so a
//! header that claims a huge array fails at the first missing byte instead
//! of reserving memory.

use rmp::Marker;

/// Nesting deeper than this is refused (a skipped value is walked
/// recursively; the engines' payloads nest four levels).
pub const MAX_DEPTH: usize = 32;

/// Why a payload did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the payload ends inside a value")]
    Truncated,
    #[error("expected {expected}, found {found}")]
    Type {
        expected: &'static str,
        found: &'static str,
    },
    #[error("values nested deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("{0} is out of range")]
    Range(&'static str),
    #[error("a string is not UTF-8")]
    Utf8,
    #[error("{0} bytes follow the batch")]
    Trailing(usize),
}

/// The head of one value: scalars whole, containers as their length.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext(&'a [u8]),
}

impl Head<'_> {
    /// The value's type, for error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool(_) => "a bool",
            Head::Uint(_) | Head::Int(_) => "an integer",
            Head::Float(_) => "a float",
            Head::Str(_) => "a string",
            Head::Bin(_) => "binary",
            Head::Array(_) => "an array",
            Head::Map(_) => "a map",
            Head::Ext(_) => "an extension",
        }
    }

    /// An integer that fits `i64`.
    pub fn as_int(&self) -> Option<i64> {
        match *self {
            Head::Int(v) => Some(v),
            Head::Uint(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A block hash: an unsigned or signed 64-bit integer (its two's
    /// complement bits), or a binary digest whose last 8 bytes, big-endian,
    /// are the value (a shorter one is zero-extended on the left).
    pub fn as_hash(&self) -> Option<u64> {
        match *self {
            Head::Uint(v) => Some(v),
            Head::Int(v) => Some(v as u64),
            Head::Bin(b) => {
                let tail = &b[b.len().saturating_sub(8)..];
                Some(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
            }
            _ => None,
        }
    }
}

/// A cursor over one msgpack document.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize, DecodeError> {
        Ok(self.be::<1>()?[0] as usize)
    }

    fn len16(&mut self) -> Result<usize, DecodeError> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }

    fn len32(&mut self) -> Result<usize, DecodeError> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    /// A container's length, refused when it could not fit in what is
    /// left (every element takes at least one byte).
    fn count(&self, n: usize, per: usize) -> Result<usize, DecodeError> {
        if n.saturating_mul(per) > self.remaining() {
            return Err(DecodeError::Truncated);
        }
        Ok(n)
    }

    /// Reads the next value's head.
    pub fn head(&mut self) -> Result<Head<'a>, DecodeError> {
        let byte = self.be::<1>()?[0];
        Ok(match Marker::from_u8(byte) {
            Marker::FixPos(v) => Head::Uint(v.into()),
            Marker::FixNeg(v) => Head::Int(v.into()),
            Marker::Null => Head::Nil,
            Marker::True => Head::Bool(true),
            Marker::False => Head::Bool(false),
            Marker::U8 => Head::Uint(self.be::<1>()?[0].into()),
            Marker::U16 => Head::Uint(u16::from_be_bytes(self.be()?).into()),
            Marker::U32 => Head::Uint(u32::from_be_bytes(self.be()?).into()),
            Marker::U64 => Head::Uint(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Head::Int(i8::from_be_bytes(self.be()?).into()),
            Marker::I16 => Head::Int(i16::from_be_bytes(self.be()?).into()),
            Marker::I32 => Head::Int(i32::from_be_bytes(self.be()?).into()),
            Marker::I64 => Head::Int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Head::Float(f32::from_be_bytes(self.be()?).into()),
            Marker::F64 => Head::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => Head::Str(self.take(n.into())?),
            Marker::Str8 => {
                let n = self.len8()?;
                Head::Str(self.take(n)?)
            }
            Marker::Str16 => {
                let n = self.len16()?;
                Head::Str(self.take(n)?)
            }
            Marker::Str32 => {
                let n = self.len32()?;
                Head::Str(self.take(n)?)
            }
            Marker::Bin8 => {
                let n = self.len8()?;
                Head::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = self.len16()?;
                Head::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.len32()?;
                Head::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => Head::Array(self.count(n.into(), 1)?),
            Marker::Array16 => {
                let n = self.len16()?;
                Head::Array(self.count(n, 1)?)
            }
            Marker::Array32 => {
                let n = self.len32()?;
                Head::Array(self.count(n, 1)?)
            }
            Marker::FixMap(n) => Head::Map(self.count(n.into(), 2)?),
            Marker::Map16 => {
                let n = self.len16()?;
                Head::Map(self.count(n, 2)?)
            }
            Marker::Map32 => {
                let n = self.len32()?;
                Head::Map(self.count(n, 2)?)
            }
            Marker::FixExt1 => Head::Ext(self.take(2)?),
            Marker::FixExt2 => Head::Ext(self.take(3)?),
            Marker::FixExt4 => Head::Ext(self.take(5)?),
            Marker::FixExt8 => Head::Ext(self.take(9)?),
            Marker::FixExt16 => Head::Ext(self.take(17)?),
            Marker::Ext8 => {
                let n = self.len8()?;
                Head::Ext(self.take(n + 1)?)
            }
            Marker::Ext16 => {
                let n = self.len16()?;
                Head::Ext(self.take(n + 1)?)
            }
            Marker::Ext32 => {
                let n = self.len32()?;
                Head::Ext(self.take(n.saturating_add(1))?)
            }
            Marker::Reserved => {
                return Err(DecodeError::Type {
                    expected: "a msgpack value",
                    found: "the reserved byte 0xc1",
                });
            }
        })
    }

    /// Skips one whole value (containers and all they hold).
    pub fn skip(&mut self) -> Result<(), DecodeError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: usize) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep);
        }
        match self.head()? {
            Head::Array(n) => (0..n).try_for_each(|_| self.skip_at(depth + 1)),
            Head::Map(n) => (0..n * 2).try_for_each(|_| self.skip_at(depth + 1)),
            _ => Ok(()),
        }
    }

    /// Skips a value whose head was already read.
    pub fn skip_rest(&mut self, head: Head<'_>) -> Result<(), DecodeError> {
        match head {
            Head::Array(n) => (0..n).try_for_each(|_| self.skip_at(1)),
            Head::Map(n) => (0..n * 2).try_for_each(|_| self.skip_at(1)),
            _ => Ok(()),
        }
    }

    /// An array's length.
    pub fn array(&mut self, what: &'static str) -> Result<usize, DecodeError> {
        match self.head()? {
            Head::Array(n) => Ok(n),
            other => Err(DecodeError::Type {
                expected: what,
                found: other.name(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_and_lengths() {
        // [1, -1, 300, "ab", nil, 0xffffffffffffffff]
        let bytes = [
            0x96, 0x01, 0xff, 0xcd, 0x01, 0x2c, 0xa2, b'a', b'b', 0xc0, 0xcf, 0xff, 0xff, 0xff,
            0xff, 0xff, 0xff, 0xff, 0xff,
        ];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.array("a list").unwrap(), 6);
        assert_eq!(r.head().unwrap(), Head::Uint(1));
        assert_eq!(r.head().unwrap(), Head::Int(-1));
        assert_eq!(r.head().unwrap().as_int(), Some(300));
        assert_eq!(r.head().unwrap(), Head::Str(b"ab"));
        assert_eq!(r.head().unwrap(), Head::Nil);
        assert_eq!(r.head().unwrap().as_hash(), Some(u64::MAX));
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn hashes_as_negative_ints_and_digests() {
        let mut digest = vec![0xc4, 32];
        digest.extend([7u8; 24]);
        digest.extend(0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(
            Reader::new(&digest).head().unwrap().as_hash().unwrap(),
            0x0102_0304_0506_0708
        );
        let neg = [0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe];
        assert_eq!(
            Reader::new(&neg).head().unwrap().as_hash().unwrap(),
            u64::MAX - 1
        );
        assert_eq!(
            Reader::new(&[0xc4, 2, 1, 2])
                .head()
                .unwrap()
                .as_hash()
                .unwrap(),
            0x0102
        );
    }

    #[test]
    fn lies_about_length_are_truncation() {
        // An array32 claiming 2^32-1 elements in 5 bytes.
        let huge = [0xdd, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(Reader::new(&huge).head(), Err(DecodeError::Truncated));
        assert_eq!(
            Reader::new(&[0xa5, b'x']).head(),
            Err(DecodeError::Truncated)
        );
        assert!(matches!(
            Reader::new(&[0xc1]).head(),
            Err(DecodeError::Type { .. })
        ));
    }

    #[test]
    fn deep_nesting_is_refused_not_recursed() {
        let deep = vec![0x91; 10_000];
        assert_eq!(Reader::new(&deep).skip(), Err(DecodeError::TooDeep));
    }
}
