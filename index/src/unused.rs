//! [`Unused`]: a file of the dataset that is not read, and why (a leaf: the walk, the
//! format planners and [`crate::error`] all name it).

/// A file the walk does not read, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unused {
    /// Path relative to the dataset directory, '/'-separated.
    pub file: String,
    /// Why it is not read, e.g. `unknown extension .txt`.
    pub reason: String,
}
