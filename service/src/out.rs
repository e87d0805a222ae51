//! Standard output for every command: [`outln!`] and [`out!`] in place of `println!` and
//! `print!`, which panic (exit 101) when a write fails, as it does once the reader of a pipe
//! has gone (`shardwire consume --jsonl | head -5`: EPIPE, since Rust ignores SIGPIPE).
//!
//! A failed write is kept, not raised: the text of that write and of every later one is
//! dropped, and [`check`] returns it. Long-running commands call [`check`] between their
//! steps (each batch, each measured run) and stop with its error; `main` ends a command whose
//! reader went away with status 0 and no message, and one whose output failed otherwise (a
//! full disk) with status 1, naming the error. SIGPIPE stays ignored in every command: `bench`
//! and `demo` run a source and a node in the process, whose sockets must see EPIPE as an
//! error, never be killed by it.

use std::fmt;
use std::io::{self, Write};
use std::sync::{Mutex, PoisonError};

/// Why standard output took no more text.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// The reader went away (a `| head` that exited): not a failure of the command.
    #[error("standard output was closed by its reader")]
    Closed,
    /// Any other write error, such as a full disk under a redirection.
    #[error("cannot write to standard output: {0} (check where it is redirected)")]
    Failed(io::Error),
}

/// An output and the first write error it met (`None` while every write went through).
pub struct Sink(Mutex<Option<io::Error>>);

impl Sink {
    const fn new() -> Self {
        Self(Mutex::new(None))
    }

    /// Writes `args` to `w`, unless an earlier write failed; a failure is kept, not returned.
    fn put(&self, w: &mut dyn Write, args: fmt::Arguments<'_>) {
        let mut failed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if failed.is_some() {
            return;
        }
        if let Err(e) = w.write_fmt(args) {
            *failed = Some(e);
        }
    }

    /// `Ok` while every write went through; else what stopped them.
    fn check(&self) -> Result<(), OutputError> {
        let failed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match &*failed {
            None => Ok(()),
            Some(e) if e.kind() == io::ErrorKind::BrokenPipe => Err(OutputError::Closed),
            Some(e) => Err(OutputError::Failed(io::Error::new(e.kind(), e.to_string()))),
        }
    }
}

/// The process's standard output.
static STDOUT: Sink = Sink::new();

/// Writes `args` to standard output (see the module doc: never panics).
pub fn write(args: fmt::Arguments<'_>) {
    STDOUT.put(&mut io::stdout().lock(), args);
}

/// `Ok` while every write to standard output went through; else why they stopped.
pub fn check() -> Result<(), OutputError> {
    STDOUT.check()
}

/// The exit status of a command that returned `result`, given the state of its output
/// (`output`, from [`check`]); `Err` holds the error to print, with status 1. A command
/// stopped by [`OutputError::Closed`] ends with 0 (its reader asked for no more); one that
/// succeeded while its output failed otherwise is a failure.
pub fn exit_status(
    result: anyhow::Result<std::process::ExitCode>,
    output: Result<(), OutputError>,
) -> Result<std::process::ExitCode, anyhow::Error> {
    match result {
        Ok(code) => match output {
            Ok(()) | Err(OutputError::Closed) => Ok(code),
            Err(e) => Err(e.into()),
        },
        Err(e) if matches!(e.downcast_ref::<OutputError>(), Some(OutputError::Closed)) => {
            Ok(std::process::ExitCode::SUCCESS)
        }
        Err(e) => Err(e),
    }
}

/// `println!` that never panics: see the module doc.
macro_rules! outln {
    () => {
        $crate::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` that never panics: see the module doc.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}

pub(crate) use out;
pub(crate) use outln;

#[cfg(test)]
mod tests {
    use std::process::ExitCode;

    use super::*;

    /// A writer whose reader has gone after `left` bytes, or that fails with `kind`.
    struct Pipe {
        taken: Vec<u8>,
        left: usize,
        kind: io::ErrorKind,
    }

    impl Write for Pipe {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            if self.left == 0 {
                return Err(io::Error::from(self.kind));
            }
            let n = b.len().min(self.left);
            self.taken.extend_from_slice(&b[..n]);
            self.left -= n;
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_reader_stops_the_output_without_a_panic() {
        // Before: `println!` panicked here ("failed printing to stdout"), exit 101.
        let (sink, kind) = (Sink::new(), io::ErrorKind::BrokenPipe);
        let mut pipe = Pipe {
            taken: Vec::new(),
            left: 7,
            kind,
        };
        sink.put(&mut pipe, format_args!("line {}\n", 1));
        assert!(sink.check().is_ok());
        sink.put(&mut pipe, format_args!("line {}\n", 2));
        assert!(matches!(sink.check(), Err(OutputError::Closed)));
        // Later writes are dropped, even where the writer would take them again.
        pipe.left = 100;
        sink.put(&mut pipe, format_args!("line {}\n", 3));
        assert_eq!(pipe.taken, b"line 1\n");
    }

    #[test]
    fn a_closed_reader_ends_with_0_and_other_failures_with_an_error() {
        // Before: consume's `writeln!(..)?` made EPIPE "Broken pipe (os error 32)", exit 1.
        let closed = || Err(OutputError::Closed);
        let stopped = exit_status(Err(OutputError::Closed.into()), closed());
        assert_eq!(stopped.unwrap(), ExitCode::SUCCESS);
        assert_eq!(
            exit_status(Ok(ExitCode::from(3)), closed()).unwrap(),
            ExitCode::from(3)
        );
        // A full disk is a failure, even when the command itself succeeded.
        let sink = Sink::new();
        let mut full = Pipe {
            taken: Vec::new(),
            left: 0,
            kind: io::ErrorKind::StorageFull,
        };
        sink.put(&mut full, format_args!("x"));
        let e = exit_status(Ok(ExitCode::SUCCESS), sink.check()).unwrap_err();
        assert!(
            e.to_string().starts_with("cannot write to standard output"),
            "{e}"
        );
        // A command's own error stays an error with its reader gone.
        let other = exit_status(Err(anyhow::anyhow!("no dataset")), closed());
        assert_eq!(other.unwrap_err().to_string(), "no dataset");
    }
}
