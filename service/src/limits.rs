//! Process limits the commands that run a source or a node (`serve`, `source`, and `bench` and
//! `demo`, which run both in one process) set for themselves at start: the open-file limit
//! goes from its soft value (often 1024) to its hard one, since a source keeps every file of
//! its datasets open and a node a socket per trainer and source. Said in the log either way.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// Raises the soft open-file limit to the hard one; returns `(before, after)` (`None`:
/// unlimited).
pub fn raise_open_files() -> (Option<u64>, Option<u64>) {
    let now = getrlimit(Resource::Nofile);
    let raised = Rlimit {
        current: now.maximum,
        maximum: now.maximum,
    };
    if now.current == now.maximum {
        return (now.current, now.current);
    }
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => {
            tracing::info!(from = ?now.current, to = ?now.maximum, "open-file limit raised to its hard limit");
            (now.current, now.maximum)
        }
        Err(e) => {
            tracing::warn!(limit = ?now.current, hard = ?now.maximum, error = %e, "cannot raise the open-file limit");
            (now.current, now.current)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_rises_to_the_hard_one() {
        let hard = getrlimit(Resource::Nofile).maximum;
        let (_, after) = raise_open_files();
        assert_eq!(after, hard);
        assert_eq!(getrlimit(Resource::Nofile).current, hard);
    }
}
