//! A lane's receiver threads run on CPUs near its NIC (DESIGN §11): the lane's CPUs that this
//! process may use ([`usable`], decided once at start) and `sched_setaffinity` of each
//! receiver thread to them ([`pin_current`]). A lane none of whose CPUs this process may use
//! (a container with a CPU set elsewhere, or a fake sysfs tree) runs unpinned and says why.

use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};
use shardwire_topology::format_ranges;

/// Why a lane's receivers cannot be pinned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PinError {
    /// None of the lane's CPUs is in this process's affinity mask.
    #[error("none of the lane's CPUs {wanted} is allowed to this process (allowed: {allowed})")]
    NoneAllowed {
        /// The lane's CPUs.
        wanted: String,
        /// This process's.
        allowed: String,
    },
    /// A scheduler call failed.
    #[error("{call}: {errno}")]
    Syscall {
        /// Which call.
        call: &'static str,
        /// Its error.
        errno: rustix::io::Errno,
    },
}

/// The CPUs this process may run on.
pub fn allowed() -> Result<Vec<u32>, PinError> {
    let set = sched_getaffinity(None).map_err(|errno| PinError::Syscall {
        call: "sched_getaffinity",
        errno,
    })?;
    Ok((0..CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .map(|c| c as u32)
        .collect())
}

/// The lane CPUs in `wanted` that are in `allowed`, or why there are none.
pub fn usable(wanted: &[u32], allowed: &[u32]) -> Result<Vec<u32>, PinError> {
    let both: Vec<u32> = wanted
        .iter()
        .copied()
        .filter(|c| allowed.contains(c))
        .collect();
    if both.is_empty() {
        return Err(PinError::NoneAllowed {
            wanted: format_ranges(wanted),
            allowed: format_ranges(allowed),
        });
    }
    Ok(both)
}

/// Runs the calling thread on `cpus` from now on.
pub fn pin_current(cpus: &[u32]) -> Result<(), PinError> {
    let mut set = CpuSet::new();
    for &c in cpus.iter().filter(|&&c| (c as usize) < CpuSet::MAX_CPU) {
        set.set(c as usize);
    }
    sched_setaffinity(None, &set).map_err(|errno| PinError::Syscall {
        call: "sched_setaffinity",
        errno,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_allowed_cpus_are_used_and_none_is_an_error_naming_both() {
        assert_eq!(usable(&[0, 1, 2, 3], &[1, 3, 5]), Ok(vec![1, 3]));
        let e = usable(&[52, 53, 54], &[0, 1]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "none of the lane's CPUs 52-54 is allowed to this process (allowed: 0-1)"
        );
    }

    #[test]
    fn a_thread_pins_to_an_allowed_cpu() {
        let all = allowed().expect("sched_getaffinity");
        assert!(!all.is_empty());
        let first = all[0];
        std::thread::spawn(move || {
            pin_current(&[first]).expect("pin");
            assert_eq!(allowed().unwrap(), [first]);
        })
        .join()
        .unwrap();
        // Pinning another thread left this one alone.
        assert_eq!(allowed().unwrap(), all);
    }
}
