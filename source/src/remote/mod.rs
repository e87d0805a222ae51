//! Datasets whose files are objects in object storage: the read-ahead the nodes' hints ask
//! for ([`hints`]) and the disk cache kept by them ([`cache`]).

pub mod cache;
pub mod hints;
