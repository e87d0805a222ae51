use std::collections::HashMap;

use super::*;

/// A fresh directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> TempDir {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("shardwire-cache-test-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    TempDir(d)
}

fn name(shard: u32) -> String {
    entry_name(
        shard,
        "data/a.bin",
        "\"etag-1\"",
        (u64::from(shard) * 100, 100),
        7,
    )
}

/// Stores `shard` (100 bytes) if the cache admits it, as `RemoteDataset::write_entry` does;
/// returns the evicted shards.
fn put(c: &mut DiskCache, shard: u32, uses: &HashMap<u32, usize>) -> Option<Vec<u32>> {
    let r = c.reserve(shard, name(shard), 100, |s| uses.get(&s).copied())?;
    r.discard_evicted();
    std::fs::write(&r.temp, [shard as u8; 100]).unwrap();
    r.install().unwrap();
    let evicted = r.evicted.clone();
    c.commit(r);
    Some(evicted)
}

/// `shard`'s entry, looked up and opened as `RemoteDataset::cached` does (the lookup under
/// the cache's lock, the open outside it).
fn get(c: &mut DiskCache, shard: u32) -> Option<Hit> {
    let found = c.lookup(shard)?;
    found.open(|s, id| c.lost(s, id))
}

#[test]
fn entries_still_read_stay_and_cold_ones_make_way_least_recently_served_first() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 300, |_| None).unwrap();
    // Cold after twice as many accesses as shards asked for: 10 once 0, 1, 2, 3 and 9 were.
    c.set_cold_after(2);
    let mut uses = HashMap::new();
    for s in 0..3 {
        assert_eq!(put(&mut c, s, &uses), Some(vec![]));
    }
    // Full: a newcomer passes through, hinted or not, while nothing is cold.
    uses.extend([(3, 1), (1, 50)]);
    assert_eq!(put(&mut c, 3, &uses), None, "no entry is cold yet");
    // 0 and 2 are served now and then; 1 is not, but a hint names it.
    for _ in 0..12 {
        get(&mut c, 0).unwrap();
        get(&mut c, 2).unwrap();
        assert!(get(&mut c, 9).is_none());
    }
    assert_eq!(
        put(&mut c, 3, &uses),
        None,
        "1 is hinted, 0 and 2 were just served"
    );
    uses.remove(&1);
    assert_eq!(put(&mut c, 3, &uses), Some(vec![1]), "1 is cold now");
    for _ in 0..12 {
        get(&mut c, 9);
    }
    get(&mut c, 2).unwrap();
    assert_eq!(
        put(&mut c, 4, &uses),
        Some(vec![0]),
        "least recently served first"
    );
    assert!(c.holds(2) && c.holds(3) && c.holds(4) && !c.holds(0) && !c.holds(1));
    assert_eq!(c.used(), 300);
    let hit = get(&mut c, 4).unwrap();
    assert!(hit.verified);
    assert_eq!(hit.len, 100);
}

#[test]
fn a_cache_larger_than_the_hints_horizon_keeps_its_slice_over_epochs() {
    // 40 shards through a cache of 20, the hints naming only the next 4: the entries of the
    // first epoch are beyond the horizon when the next epoch's reads come, and stay.
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 2000, |_| None).unwrap();
    c.set_cold_after(8);
    let mut hits = 0;
    for epoch in 0..4u32 {
        for i in 0..40u32 {
            let s = (i * 7 + epoch * 13) % 40; // another order each epoch
            let uses: HashMap<u32, usize> =
                (0..4).map(|k| ((s + k * 7) % 40, k as usize)).collect();
            if get(&mut c, s).is_some() {
                hits += u32::from(epoch > 0);
            } else {
                let _ = put(&mut c, s, &uses);
            }
        }
    }
    assert_eq!(hits, 60, "epochs 2 to 4 each hit the 20 cached shards");
    // Then a job reads only shards 40..60 (another part of the dataset): the old entries go
    // cold and make way.
    for _ in 0..20 {
        for s in 40..60u32 {
            if get(&mut c, s).is_none() {
                let _ = put(&mut c, s, &HashMap::from([(s, 0)]));
            }
        }
    }
    assert!((40..60).all(|s| c.holds(s)), "the new part is cached");
}

#[test]
fn a_shard_needed_later_than_everything_cached_passes_through() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 200, |_| None).unwrap();
    let uses: HashMap<u32, usize> = [(0, 1), (1, 2), (2, 3)].into();
    put(&mut c, 0, &uses).unwrap();
    put(&mut c, 1, &uses).unwrap();
    assert!(put(&mut c, 2, &uses).is_none());
    assert!(c.holds(0) && c.holds(1));
}

#[test]
fn with_no_hints_the_first_slice_stays_from_epoch_to_epoch() {
    // The LRU failure mode: a dataset of 5 shards through a cache of 3, twice in a row.
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 300, |_| None).unwrap();
    let none = HashMap::new();
    let mut hits = 0;
    for _epoch in 0..2 {
        for s in 0..5 {
            if get(&mut c, s).is_some() {
                hits += 1;
            } else {
                let _ = put(&mut c, s, &none);
            }
        }
    }
    assert_eq!(hits, 3, "the second epoch hits the three cached shards");
}

#[test]
fn a_restart_keeps_entries_the_manifest_still_names() {
    let dir = tempdir();
    {
        let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
        for s in 0..3 {
            put(&mut c, s, &HashMap::new()).unwrap();
        }
    }
    std::fs::write(dir.path().join(format!(".{}.partial", name(9))), b"half").unwrap();
    // Shard 1's object changed (another name); shard 2's file was truncated.
    std::fs::write(dir.path().join(name(2)), b"short").unwrap();
    let expect = |s: u32| match s {
        1 => Some((
            entry_name(1, "data/a.bin", "\"etag-2\"", (100, 100), 7),
            100,
        )),
        s => Some((name(s), 100)),
    };
    let (mut c, loaded) = DiskCache::open(dir.path(), 1000, expect).unwrap();
    assert_eq!(loaded.kept, 1);
    assert_eq!(loaded.kept_bytes, 100);
    assert_eq!(loaded.removed.len(), 3, "{:?}", loaded.removed);
    let hit = get(&mut c, 0).unwrap();
    assert!(!hit.verified, "a kept entry is checked on its first serve");
    assert!(get(&mut c, 1).is_none() && get(&mut c, 2).is_none());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn files_the_cache_did_not_write_are_named_and_left_alone() {
    let dir = tempdir();
    let foreign = [
        "s000.npy",
        "00000001-notahexhash00.shard",
        "notes.txt",
        ".hidden",
    ];
    std::fs::create_dir_all(dir.path()).unwrap();
    for f in foreign {
        std::fs::write(dir.path().join(f), b"user data").unwrap();
    }
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    std::fs::write(dir.path().join(format!(".{}.evicted", name(4))), b"old").unwrap();
    let (_, loaded) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
    let mut named = loaded.foreign.clone();
    named.sort();
    assert_eq!(
        named,
        [
            ".hidden",
            "00000001-notahexhash00.shard",
            "notes.txt",
            "s000.npy",
            "sub"
        ]
    );
    assert_eq!(loaded.removed, [format!(".{}.evicted", name(4))]);
    for f in foreign {
        assert_eq!(
            std::fs::read(dir.path().join(f)).unwrap(),
            b"user data",
            "{f}"
        );
    }
}

#[test]
fn a_restart_with_a_lower_cache_size_deletes_down_to_it() {
    let dir = tempdir();
    {
        let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
        for s in 0..5 {
            put(&mut c, s, &HashMap::new()).unwrap();
        }
    }
    let (mut c, loaded) = DiskCache::open(dir.path(), 250, |s| Some((name(s), 100))).unwrap();
    assert_eq!((loaded.kept, loaded.kept_bytes, c.used()), (2, 200, 200));
    assert_eq!(loaded.over_size, vec![name(4), name(3), name(2)]);
    assert!(loaded.removed.is_empty(), "{:?}", loaded.removed);
    assert!(get(&mut c, 0).is_some() && get(&mut c, 1).is_some() && get(&mut c, 2).is_none());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn an_entry_whose_file_went_leaves_the_index_and_its_room() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
    put(&mut c, 3, &HashMap::new()).unwrap();
    std::fs::remove_file(dir.path().join(name(3))).unwrap();
    assert!(get(&mut c, 3).is_none());
    assert!(!c.holds(3), "the shard can be cached again");
    assert_eq!((c.used(), c.len()), (0, 0));
    put(&mut c, 3, &HashMap::new()).expect("admitted again");
    assert!(get(&mut c, 3).is_some());
}

#[test]
fn an_entry_that_cannot_be_opened_for_another_reason_stays() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
    put(&mut c, 3, &HashMap::new()).unwrap();
    // A file that is there but cannot be opened (as when the source is out of file
    // descriptors): a symbolic link to itself, which open(2) refuses with ELOOP.
    let path = dir.path().join(name(3));
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(&path, &path).unwrap();
    assert!(get(&mut c, 3).is_none(), "not served");
    assert!(c.holds(3), "the entry stays in the index");
    assert_eq!((c.used(), c.len()), (100, 1));
    assert!(std::fs::symlink_metadata(&path).is_ok(), "and on disk");
}

#[test]
fn a_failed_check_deletes_only_an_entry_not_checked_since_a_restart() {
    let dir = tempdir();
    {
        let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
        put(&mut c, 0, &HashMap::new()).unwrap();
    }
    let (mut c, _) = DiskCache::open(dir.path(), 1000, |s| Some((name(s), 100))).unwrap();
    put(&mut c, 1, &HashMap::new()).unwrap();
    let id1 = c.lookup(1).expect("cached").id;
    assert!(c.remove_unverified(1, id1).is_none());
    assert!(
        get(&mut c, 1).is_some(),
        "written since the restart: verified, kept"
    );
    // Taken out of the index under the cache's lock; its file is deleted after, outside it
    // (before, it was renamed aside, or unlinked, under the lock).
    let id0 = c.lookup(0).expect("kept").id;
    let doomed = c.remove_unverified(0, id0).expect("taken out");
    assert!(get(&mut c, 0).is_none());
    assert_eq!((c.used(), c.len()), (100, 1));
    assert_eq!(doomed, dir.path().join(name(0)));
    assert!(doomed.exists(), "deleted outside the lock");
    assert!(
        c.reserve(0, name(0), 100, |_| None).is_none(),
        "not cached again while its old file is deleted"
    );
    delete(&doomed);
    c.deleted(0);
    assert!(!doomed.exists());
    assert!(c.remove_unverified(0, id0).is_none(), "gone already");
    put(&mut c, 0, &HashMap::new()).expect("cached again");
}

/// Two FETCHes check the same entry kept over a restart, whose bytes are bad; the first
/// result deletes it, the shard is cached again (good bytes) and then reported corrupt. The
/// other FETCH's check of the old file, ending last, neither deletes the new entry nor marks
/// it checked. Before, both took the shard only: the stale failure deleted the good entry (a
/// needless delete and GET), and a stale success skipped the recheck a node asked for.
#[test]
fn a_late_check_of_an_old_entry_leaves_the_entry_written_since_alone() {
    let dir = tempdir();
    {
        let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
        put(&mut c, 0, &HashMap::new()).unwrap();
    }
    let (mut c, _) = DiskCache::open(dir.path(), 1000, |s| Some((name(s), 100))).unwrap();
    let (f1, f2) = (get(&mut c, 0).expect("kept"), get(&mut c, 0).expect("kept"));
    assert!(!f1.verified && f1.id == f2.id, "one entry, not checked yet");
    // F2's check fails first: the entry goes, its file is deleted.
    let doomed = c.remove_unverified(0, f2.id).expect("taken out");
    delete(&doomed);
    c.deleted(0);
    // Read again and cached (verified), then a node reports its bytes.
    put(&mut c, 0, &HashMap::new()).expect("cached again");
    c.recheck(0);
    let new = c.lookup(0).expect("the new entry").id;
    assert_ne!(new, f1.id);
    // F1's check of the old file ends now.
    c.verified(0, f1.id);
    assert!(
        !c.lookup(0).expect("kept").verified,
        "still to be checked, as the report asked"
    );
    assert!(
        c.remove_unverified(0, f1.id).is_none(),
        "the entry written since stays"
    );
    assert!(c.holds(0) && c.used() == 100);
    assert!(dir.path().join(name(0)).exists(), "its file too");
    // Its own check counts.
    c.verified(0, new);
    assert!(c.lookup(0).expect("kept").verified);
}

#[test]
fn an_entry_cut_short_is_taken_out_and_one_written_anew_since_stays() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
    put(&mut c, 2, &HashMap::new()).unwrap();
    let cut = get(&mut c, 2).expect("cached").id;
    std::fs::write(dir.path().join(name(2)), b"short").unwrap();
    let doomed = c.remove_cut_short(2, cut).expect("cut short: taken out");
    assert!(!c.holds(2) && c.used() == 0);
    delete(&doomed);
    c.deleted(2);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // Read and cached again, whole, while another FETCH found the old entry cut short.
    put(&mut c, 2, &HashMap::new()).expect("cached again");
    assert!(c.remove_cut_short(2, cut).is_none(), "written anew: kept");
    assert!(c.holds(2) && get(&mut c, 2).is_some_and(|h| h.id != cut));
}

#[test]
fn entries_no_longer_asked_for_go_cold_within_epochs_of_this_caches_own_traffic() {
    // One of four sources behind one DNS name, over a dataset of 400 shards: this cache is
    // asked for its slice, 0..100, and holds all of it. Then the routing changes, and it is
    // asked for 100..200 instead: those pass through uncached (read from the bucket every
    // epoch) until the old entries are cold. Counted by the dataset's 400 shards (8 x 400
    // accesses), that took 18 epochs; by this cache's own, 10.
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 100 * 100, |_| None).unwrap();
    c.set_cold_after(8);
    let none = HashMap::new();
    let mut epoch = |slice: std::ops::Range<u32>| {
        let mut misses = 0;
        for s in slice {
            if get(&mut c, s).is_none() {
                misses += 1;
                let _ = put(&mut c, s, &none);
            }
        }
        misses
    };
    for _ in 0..3 {
        epoch(0..100);
    }
    assert_eq!(epoch(0..100), 0, "the slice stays cached");
    let cached_after = (1..=30).find(|_| epoch(100..200) == 0);
    assert!(
        cached_after.is_some_and(|n| n <= 12),
        "the new slice is served from the cache after {cached_after:?} epochs"
    );
}

#[test]
fn a_stale_file_that_cannot_be_deleted_is_named() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir();
    std::fs::create_dir_all(dir.path()).unwrap();
    let stale = dir.path().join(name(1));
    std::fs::write(&stale, b"old").unwrap();
    let mode = |m| std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(m));
    mode(0o555).unwrap();
    // Root deletes it all the same (permissions are not enforced for it): then the error is
    // made as the start would make it, for its message.
    let enforced = std::fs::write(dir.path().join("probe"), b"").is_err();
    let e = match enforced {
        true => DiskCache::open(dir.path(), 1000, |_| None).unwrap_err(),
        false => CacheError::Stale {
            dir: dir.path().to_path_buf(),
            file: stale.clone(),
            source: std::io::ErrorKind::PermissionDenied.into(),
        },
    };
    mode(0o755).unwrap();
    // Before, `cache_dir DIR: Permission denied`, naming no file.
    assert!(
        matches!(&e, CacheError::Stale { file, .. } if *file == stale),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains(&stale.display().to_string()) && text.contains("write access"),
        "{text}"
    );
}

#[test]
fn an_evicted_file_is_deleted_outside_the_lock_and_its_shard_waits_for_that() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 200, |_| None).unwrap();
    c.set_cold_after(0);
    put(&mut c, 1, &HashMap::new()).unwrap();
    put(&mut c, 0, &HashMap::new()).unwrap();
    let uses = HashMap::from([(2, 1)]);
    let r = c
        .reserve(2, name(2), 100, |s| uses.get(&s).copied())
        .unwrap();
    assert_eq!(r.evicted, vec![1]);
    assert!(!c.holds(1) && c.used() == 200, "out of the index");
    // Before, `reserve` renamed it aside, under the lock the dataset's FETCHes take.
    assert_eq!(r.doomed, [dir.path().join(name(1))]);
    assert!(r.doomed[0].exists(), "no file touched under the lock");
    // A new file of shard 1 would take the name of the one about to be deleted.
    assert!(
        c.reserve(1, name(1), 100, |_| None).is_none(),
        "not cached again until its old file is gone"
    );
    r.discard_evicted();
    assert!(!r.doomed[0].exists());
    r.discard_evicted(); // already gone: no error
    std::fs::write(&r.temp, [2u8; 100]).unwrap();
    r.install().unwrap();
    c.commit(r);
    assert_eq!(c.used(), 200);
    let again = c.reserve(1, name(1), 100, |_| None);
    let again = again.expect("cached again once its old file is gone");
    assert_eq!(again.evicted, vec![0], "least recently served first");
    again.discard_evicted();
    c.abort(again);
    let (_, loaded) = DiskCache::open(dir.path(), 200, |s| Some((name(s), 100))).unwrap();
    assert_eq!(loaded.kept, 1, "{loaded:?}");
}

#[test]
fn room_is_looked_for_among_the_cold_entries_only_least_recently_served_first() {
    // Entries are indexed only (no files: victims are chosen in the index).
    let dir = tempdir();
    let n = 10_000u32;
    let (mut c, _) = DiskCache::open(dir.path(), u64::from(n) * 100, |_| None).unwrap();
    c.set_cold_after(1);
    for s in 0..n {
        let r = c.reserve(s, name(s), 100, |_| None).expect("fits");
        c.commit(r);
    }
    // Full, every entry served lately: the next shard passes through, and no entry was
    // looked at (before, all 10 000 were, under the dataset's lock, for every shard read).
    assert!(c.reserve(n, name(n), 100, |_| None).is_none());
    assert_eq!(c.visited, 0, "entries looked at");
    // All but 0, 1 and 2 are served again: those three go cold. A hint names 1.
    for _ in 0..2 {
        for s in 3..n {
            c.lookup(s).expect("cached");
        }
    }
    let uses = HashMap::from([(1, 0)]);
    let next_use = |s: u32| uses.get(&s).copied();
    assert!(
        c.reserve(n, name(n), 300, next_use).is_none(),
        "two cold entries no hint names hold 200 bytes, not 300"
    );
    assert_eq!(
        c.visited, 3,
        "the cold ones, and the first warm one stops the walk"
    );
    assert!((0..3).all(|s| c.holds(s)), "nothing evicted");
    let r = c.reserve(n, name(n), 200, next_use).expect("room");
    assert_eq!(
        r.evicted,
        vec![0, 2],
        "least recently served first, 1 hinted"
    );
    assert_eq!(c.visited, 3);
    assert!(c.holds(1) && c.holds(3));
}

#[test]
fn an_aborted_write_gives_its_room_back() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 100, |_| None).unwrap();
    let r = c.reserve(0, name(0), 100, |_| None).unwrap();
    assert!(c.holds(0));
    assert!(
        c.reserve(1, name(1), 100, |_| Some(0)).is_none(),
        "no room while reserved"
    );
    assert_eq!(r.set_aside(), None, "nothing was written");
    c.abort(r);
    assert_eq!(c.used(), 0);
    assert!(!c.holds(0));
    assert!(c.reserve(1, name(1), 100, |_| None).is_some());
}

#[test]
fn a_partial_write_is_set_aside_under_the_lock_and_deleted_outside_it() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 100, |_| None).unwrap();
    let r = c.reserve(0, name(0), 100, |_| None).unwrap();
    let temp = r.temp.clone();
    std::fs::write(&temp, [0u8; 60]).unwrap(); // the disk filled up here
    let doomed = r.set_aside().expect("the partial file, set aside");
    c.abort(r);
    // Before, `abort` unlinked it under the cache's lock (a shard-sized file: slow), and
    // then renamed it aside there; both run outside the lock now.
    assert!(doomed.exists(), "the unlink waits for `delete`");
    assert!(!temp.exists(), "the temp name is free at once");
    assert!(is_cache_file(
        &doomed.file_name().unwrap().to_string_lossy()
    ));
    assert_eq!(c.used(), 0);
    // A new reservation of the same entry writes and commits its temp file meanwhile.
    let again = c.reserve(0, name(0), 100, |_| None).unwrap();
    std::fs::write(&again.temp, [0u8; 100]).unwrap();
    again.install().unwrap();
    c.commit(again);
    delete(&doomed);
    assert!(!doomed.exists());
    assert_eq!(get(&mut c, 0).expect("kept").len, 100);
}

#[test]
fn a_commit_that_cannot_rename_sets_the_file_aside_and_gives_its_room_back() {
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 100, |_| None).unwrap();
    let r = c.reserve(0, name(0), 100, |_| None).unwrap();
    std::fs::write(&r.temp, [0u8; 100]).unwrap();
    // A directory (not empty) where the entry goes: the rename fails.
    let blocker = dir.path().join(name(0));
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("x"), b"x").unwrap();
    let temp = r.temp.clone();
    let e = r.install().expect_err("the rename fails");
    c.abort(r);
    let doomed = e.doomed.expect("the written file, set aside");
    // Before, `commit` unlinked it under the cache's lock.
    assert!(doomed.exists() && !temp.exists());
    assert_eq!(c.used(), 0);
    assert!(!c.holds(0));
    delete(&doomed);
    assert!(!doomed.exists());
}

#[test]
fn caches_that_fit_the_disk_each_but_not_together_are_refused_naming_the_others() {
    // Two datasets' caches on one file system: before, each was checked alone, both opened,
    // and the disk filled up later. A file system of the test's own (id and free bytes), so
    // other tests' caches neither count here nor are refused for this one.
    let (a, b) = (tempdir(), tempdir());
    let room = |_: &Path| Ok((u64::MAX - 11, 1000u64));
    let first = DiskCache::open_in(a.path(), 600, |_| None, &room)
        .unwrap()
        .0;
    let e = DiskCache::open_in(b.path(), 600, |_| None, &room).unwrap_err();
    assert!(matches!(e, CacheError::NoRoom { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("other caches of this source")
            && text.contains(&a.path().display().to_string()),
        "{text}"
    );
    drop(first);
    assert!(DiskCache::open_in(b.path(), 600, |_| None, &room).is_ok());
}

#[test]
fn a_cache_larger_than_the_disk_is_refused_at_open() {
    let dir = tempdir();
    let e = DiskCache::open(dir.path(), u64::MAX / 2, |_| None).unwrap_err();
    assert!(matches!(e, CacheError::NoRoom { .. }), "{e}");
    assert!(e.to_string().contains("lower cache_size"), "{e}");
}

/// One epoch of `slice` with no hints: each shard looked up, and stored on a miss if the
/// cache admits it; returns the misses.
fn epoch_of(c: &mut DiskCache, slice: std::ops::Range<u32>) -> usize {
    let mut misses = 0;
    for s in slice {
        if get(c, s).is_none() {
            misses += 1;
            let _ = put(c, s, &HashMap::new());
        }
    }
    misses
}

#[test]
fn after_each_routing_change_the_new_slice_is_cached_within_as_many_epochs() {
    // One of several sources behind one DNS name, whose slice changes five times (0..100,
    // then 100..200, ... 500..600), each served until it is all cached. Before, every shard
    // ever asked for stayed counted: after the fifth change the old entries went cold only
    // after 8 x 600 accesses, and the new slice passed through uncached for 26 epochs (four
    // more at each change). Counted for two generations of accesses: 13 at most.
    let dir = tempdir();
    let (mut c, _) = DiskCache::open(dir.path(), 100 * 100, |_| None).unwrap();
    c.set_cold_after(8);
    let mut took = Vec::new();
    for k in 0..6u32 {
        let slice = k * 100..(k + 1) * 100;
        took.push((1..=40).find(|_| epoch_of(&mut c, slice.clone()) == 0));
    }
    assert_eq!(took[0], Some(2), "the first slice is cached as it is read");
    assert!(
        took[1..].iter().all(|n| n.is_some_and(|n| n <= 14)),
        "epochs until each new slice was cached: {took:?}"
    );
    // Once only its slice is asked for, only it counts (before, all 600 shards did).
    for _ in 0..20 {
        epoch_of(&mut c, 500..600);
    }
    assert_eq!(c.cold_after(), 8 * 100);
}

#[test]
fn a_shard_still_read_stays_counted_and_one_no_longer_asked_for_is_forgotten() {
    // 100 shards read every epoch, in an order that puts the most accesses between two asks
    // of a shard (ascending, then descending), once or three times each (a hit; or a lookup,
    // a reservation and a lookup), over many generations.
    let mut a = Asked::default();
    let mut counted = Vec::new();
    for e in 0..60u32 {
        let order: Vec<u32> = match e % 2 {
            0 => (0..100).collect(),
            _ => (0..100).rev().collect(),
        };
        let times = if e % 3 == 0 { 3 } else { 1 };
        for s in order {
            for _ in 0..times {
                a.note(s);
                counted.push(a.distinct);
            }
        }
    }
    let (least, most) = (counted[300..].iter().min(), counted[300..].iter().max());
    assert_eq!(
        (least, most),
        (Some(&100), Some(&100)),
        "after the first epoch"
    );
    // Then only 100..150 are asked for: 0..100 stop counting.
    for _ in 0..60 {
        for s in 100..150 {
            a.note(s);
        }
    }
    assert_eq!(a.distinct, 50);
    let counts = |s| a.now.contains(s) || a.before.contains(s);
    assert!(!counts(5) && counts(120));
}

/// The gauges registered while it is the local recorder: name, labels and last value each.
#[derive(Default)]
struct Gauges(std::sync::Mutex<Vec<(metrics::Key, std::sync::Arc<LastValue>)>>);

/// A gauge's last value (an `f64`'s bits).
#[derive(Default)]
struct LastValue(std::sync::atomic::AtomicU64);

impl LastValue {
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(std::sync::atomic::Ordering::Acquire))
    }
}

impl metrics::GaugeFn for LastValue {
    fn increment(&self, value: f64) {
        self.set(self.get() + value);
    }

    fn decrement(&self, value: f64) {
        self.set(self.get() - value);
    }

    fn set(&self, value: f64) {
        let bits = value.to_bits();
        self.0.store(bits, std::sync::atomic::Ordering::Release);
    }
}

impl metrics::Recorder for Gauges {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }

    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }

    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        let last = std::sync::Arc::new(LastValue::default());
        self.0
            .lock()
            .unwrap()
            .push((key.clone(), std::sync::Arc::clone(&last)));
        metrics::Gauge::from_arc(last)
    }

    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

#[test]
fn the_cache_bytes_gauge_is_per_dataset_set_at_open_and_at_every_change() {
    let dir = tempdir();
    {
        let (mut c, _) = DiskCache::open(dir.path(), 1000, |_| None).unwrap();
        for s in 0..3 {
            put(&mut c, s, &HashMap::new()).unwrap();
        }
    }
    // A restart keeps three entries; no commit follows (every FETCH a hit).
    let (mut c, _) = DiskCache::open(dir.path(), 1000, |s| Some((name(s), 100))).unwrap();
    let gauges = Gauges::default();
    metrics::with_local_recorder(&gauges, || c.report_as("web"));
    let (key, value) = gauges.0.lock().unwrap().pop().expect("registered");
    assert_eq!(key.name(), "shardwire_source_cache_bytes");
    let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
    assert_eq!(labels, [("dataset", "web")]);
    // Before: absent until a commit, then set only at commits.
    assert_eq!(value.get(), 300.0, "the entries kept at open");
    let r = c.reserve(5, name(5), 100, |_| None).unwrap();
    assert_eq!(value.get(), 400.0, "a reservation");
    c.abort(r);
    assert_eq!(value.get(), 300.0, "an aborted write");
    std::fs::remove_file(dir.path().join(name(1))).unwrap();
    assert!(get(&mut c, 1).is_none());
    assert_eq!(value.get(), 200.0, "an entry whose file went");
    let kept = c.lookup(0).expect("kept").id;
    let doomed = c
        .remove_unverified(0, kept)
        .expect("not checked since the restart");
    assert_eq!(value.get(), 100.0, "an entry that failed its check");
    delete(&doomed);
    let cut = get(&mut c, 2).expect("cached").id;
    let doomed = c.remove_cut_short(2, cut).expect("cut short");
    assert_eq!(value.get(), 0.0, "an entry cut short");
    delete(&doomed);
    put(&mut c, 6, &HashMap::new()).unwrap();
    assert_eq!(value.get(), 100.0, "a commit");
    assert_eq!(value.get(), c.used() as f64);
}
