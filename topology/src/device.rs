//! How a GPU is named across processes: its PCI bus id or its UUID, never a CUDA ordinal
//! (ordinals change with `CUDA_VISIBLE_DEVICES`; DESIGN §11). A trainer names its GPU with
//! either at attach, a lane table with either in the configuration.
//!
//! UUIDs are spelled as `nvidia-smi -L` prints them, `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`
//! (lower-case hex); parsing also takes the bare 32 hex digits with or without dashes (what
//! `torch.cuda.get_device_properties(d).uuid` prints) and upper case.

use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};

use crate::pci::PciAddr;

/// A GPU UUID (16 bytes), shown as `GPU-8-4-4-4-12` lower-case hex.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuUuid(pub [u8; 16]);

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GPU-")?;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl Serialize for GpuUuid {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A GPU name that is neither a PCI bus id nor a UUID; carries the input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{0}` names no GPU: give a PCI bus id (dddd:bb:dd.f, as `shardwire topology` lists them) or a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
)]
pub struct GpuNameError(pub String);

impl FromStr for GpuUuid {
    type Err = GpuNameError;

    fn from_str(s: &str) -> Result<Self, GpuNameError> {
        let body = match s.get(..4) {
            Some(p) if p.eq_ignore_ascii_case("gpu-") => &s[4..],
            _ => s,
        };
        let digits: Vec<u8> = body.bytes().filter(|b| *b != b'-').collect();
        let err = || GpuNameError(s.to_owned());
        if digits.len() != 32 {
            return Err(err());
        }
        let mut out = [0u8; 16];
        for (o, pair) in out.iter_mut().zip(digits.chunks(2)) {
            let text = std::str::from_utf8(pair).map_err(|_| err())?;
            if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            *o = u8::from_str_radix(text, 16).map_err(|_| err())?;
        }
        Ok(Self(out))
    }
}

/// A GPU as a trainer or a lane table names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuName {
    /// By PCI bus id.
    Pci(PciAddr),
    /// By UUID.
    Uuid(GpuUuid),
}

impl FromStr for GpuName {
    type Err = GpuNameError;

    fn from_str(s: &str) -> Result<Self, GpuNameError> {
        if let Ok(p) = s.parse::<PciAddr>() {
            return Ok(Self::Pci(p));
        }
        s.parse::<GpuUuid>()
            .map(Self::Uuid)
            .map_err(|_| GpuNameError(s.to_owned()))
    }
}

impl fmt::Display for GpuName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pci(p) => p.fmt(f),
            Self::Uuid(u) => u.fmt(f),
        }
    }
}

impl Serialize for GpuName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl GpuName {
    /// True if this names the GPU at `pci` with UUID `uuid` (when known).
    pub fn is(&self, pci: Option<PciAddr>, uuid: Option<GpuUuid>) -> bool {
        match self {
            Self::Pci(p) => pci == Some(*p),
            Self::Uuid(u) => uuid == Some(*u),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "GPU-8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6";

    #[test]
    fn uuids_parse_in_every_spelling_and_print_as_nvidia_smi_does() {
        for s in [
            UUID,
            "gpu-8F6D7C3A-1B2C-4D5E-8F90-A1B2C3D4E5F6",
            "8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
            "8f6d7c3a1b2c4d5e8f90a1b2c3d4e5f6",
        ] {
            let u: GpuUuid = s.parse().unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(u.to_string(), UUID);
        }
        for bad in [
            "",
            "GPU-",
            "GPU-8f6d7c3a",
            "MIG-8f6d7c3a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
            "zz6d7c3a1b2c4d5e8f90a1b2c3d4e5f6",
        ] {
            assert!(bad.parse::<GpuUuid>().is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_pci_ids_or_uuids() {
        let p: GpuName = "0000:19:00.0".parse().unwrap();
        assert_eq!(p, GpuName::Pci("0000:19:00.0".parse().unwrap()));
        assert_eq!(
            "0000:0A:00.0".parse::<GpuName>().unwrap().to_string(),
            "0000:0a:00.0"
        );
        let u: GpuName = UUID.parse().unwrap();
        assert_eq!(u.to_string(), UUID);
        assert!(u.is(None, Some(UUID.parse().unwrap())));
        assert!(!u.is("0000:19:00.0".parse().ok(), None));
        assert!(p.is("0000:19:00.0".parse().ok(), None));
        let e = "cuda:3".parse::<GpuName>().unwrap_err();
        assert!(e.to_string().contains("`cuda:3` names no GPU"), "{e}");
    }
}
