use super::*;
use crate::arena::Arena;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::thread;

const LEN: usize = 64 << 10;

fn filled(arena: &Arc<Arena>, byte: u8) -> Arc<SlotLease> {
    let s = Arc::new(arena.try_lease().unwrap());
    s.copy_in(0, &vec![byte; LEN]).unwrap();
    s.set_len(LEN).unwrap();
    s
}

fn spec(dir: &Path, name: &str) -> Spec {
    let dest = dir.join(format!("{name}.chunk"));
    Spec {
        root: None,
        tmp: dir
            .join(format!(".{name}.tmp"))
            .to_str()
            .unwrap()
            .to_owned(),
        dest: dest.to_str().unwrap().to_owned(),
        head: vec![7u8; 4096],
        length: LEN as u64,
        release_slot: false,
        durable: true,
    }
}

fn temp_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "tmp"))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits (bounded) until the chain given up on has removed its temp file.
fn until_no_temp_file(dir: &Path) {
    for _ in 0..500 {
        if temp_files(dir).is_empty() {
            return;
        }
        thread::sleep(Duration::from_millis(10));
    }
    panic!("temp files left: {:?}", temp_files(dir));
}

#[test]
fn a_record_is_published_whole_in_new_private_directories() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model/layout");
    let arena = Arena::new(2, LEN).unwrap();
    let slot = filled(&arena, 3);
    let mut s = spec(&dir, "a");
    s.root = Some(root.path().to_str().unwrap().to_owned());
    let got = publish(&slot, s.clone(), Some(Duration::from_secs(10))).unwrap();
    let bytes = std::fs::read(&s.dest).unwrap();
    assert_eq!(bytes.len(), 4096 + LEN);
    assert!(bytes[..4096].iter().all(|&b| b == 7) && bytes[4096..].iter().all(|&b| b == 3));
    let meta = std::fs::metadata(&s.dest).unwrap();
    assert_eq!(
        (got.size, got.ino),
        (meta.len(), std::os::unix::fs::MetadataExt::ino(&meta))
    );
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert!(temp_files(&dir).is_empty());
    // The slot was not asked to go back: it is still leased, unchanged.
    assert_eq!(arena.free_slots(), 1);
    slot.release().unwrap();
}

#[test]
fn a_slot_given_back_is_in_the_ring_once_published() {
    let dir = tempfile::tempdir().unwrap();
    let arena = Arena::new(1, LEN).unwrap();
    let slot = filled(&arena, 1);
    let mut s = spec(dir.path(), "b");
    s.release_slot = true;
    publish(&slot, s, None).unwrap();
    assert_eq!(arena.free_slots(), 1);
    assert!(slot.is_released());
}

#[test]
fn an_unaligned_record_is_written_buffered_and_whole() {
    let dir = tempfile::tempdir().unwrap();
    let arena = Arena::new(1, LEN).unwrap();
    let slot = filled(&arena, 9);
    let mut s = spec(dir.path(), "c");
    s.head = vec![1u8; 100];
    s.length = 1000;
    publish(&slot, s.clone(), None).unwrap();
    let bytes = std::fs::read(&s.dest).unwrap();
    assert_eq!(bytes.len(), 1100);
    assert!(bytes[..100].iter().all(|&b| b == 1) && bytes[100..].iter().all(|&b| b == 9));
}

#[test]
fn a_failed_step_publishes_nothing_and_says_which() {
    let dir = tempfile::tempdir().unwrap();
    let arena = Arena::new(1, LEN).unwrap();
    let slot = filled(&arena, 1);
    // The final name is a non-empty directory: the rename fails, after the write.
    let s = spec(dir.path(), "d");
    std::fs::create_dir_all(Path::new(&s.dest).join("x")).unwrap();
    let err = publish(&slot, s.clone(), Some(Duration::from_secs(10))).unwrap_err();
    assert!(matches!(err, Error::Os { op: "rename", .. }), "{err:?}");
    assert!(temp_files(dir.path()).is_empty());
    // Outside the store's directory: refused at the creation.
    let mut out = spec(dir.path(), "e");
    out.root = Some(dir.path().join("store").to_str().unwrap().to_owned());
    let err = publish(&slot, out, None).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Os {
                op: "temp file's creation",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(temp_files(dir.path()).is_empty());
}

/// Each step held as a stalled drive would hold it (the stall double): the caller gets
/// `Stalled` naming it at the deadline. Released, a chain given up on before its rename
/// removes its temp file and publishes nothing; the slot stays out of the ring until
/// its bytes were written.
#[test]
fn a_stalled_step_ends_the_wait_at_the_deadline() {
    let arena = Arena::new(2, LEN).unwrap();
    for step in [
        Step::Create,
        Step::Write,
        Step::Sync,
        Step::Rename,
        Step::DirSync,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let slot = filled(&arena, 5);
        let s = spec(dir.path(), "f");
        let stall = stall::arm(step, dir.path().to_str().unwrap());
        let t0 = Instant::now();
        let err = publish(&slot, s.clone(), Some(Duration::from_millis(300))).unwrap_err();
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(3),
            "{took:?}"
        );
        match &err {
            Error::Stalled { step: what, path } => {
                assert_eq!((*what, path.as_str()), (step.describe(), s.tmp.as_str()))
            }
            other => panic!("{step:?}: {other:?}"),
        }
        assert_eq!(stall.hits(), 1);
        // Until its bytes are written the slot cannot be given back; after, at once.
        let early = matches!(step, Step::Create | Step::Write);
        assert_eq!(slot.release().is_err(), early, "{step:?}");
        stall.release();
        until_no_temp_file(dir.path());
        let published = Path::new(&s.dest).exists();
        // A rename already in the kernel completes: the record was whole and durable.
        assert_eq!(
            published,
            matches!(step, Step::Rename | Step::DirSync),
            "{step:?}"
        );
        if published {
            assert_eq!(std::fs::read(&s.dest).unwrap().len(), 4096 + LEN);
        }
        for _ in 0..500 {
            if slot.release().is_ok() {
                break;
            }
            thread::sleep(Duration::from_millis(10));
        }
        assert!(slot.is_released(), "{step:?}");
    }
    // Control: unarmed, the same publication ends well within that deadline.
    let dir = tempfile::tempdir().unwrap();
    let slot = filled(&arena, 5);
    publish(
        &slot,
        spec(dir.path(), "g"),
        Some(Duration::from_millis(300)),
    )
    .unwrap();
}

#[test]
fn a_stall_elsewhere_does_not_hold_this_directory() {
    let here = tempfile::tempdir().unwrap();
    let there = tempfile::tempdir().unwrap();
    let stall = stall::arm(Step::Write, there.path().to_str().unwrap());
    let arena = Arena::new(1, LEN).unwrap();
    let slot = filled(&arena, 2);
    publish(&slot, spec(here.path(), "h"), Some(Duration::from_secs(5))).unwrap();
    assert_eq!(stall.hits(), 0);
    stall.release();
}

#[test]
fn publications_run_side_by_side_while_one_is_stalled() {
    let dir = tempfile::tempdir().unwrap();
    let stalled_dir = dir.path().join("stalled");
    std::fs::create_dir(&stalled_dir).unwrap();
    let stall = stall::arm(Step::Sync, stalled_dir.to_str().unwrap());
    let arena = Arena::new(3, LEN).unwrap();
    let held = filled(&arena, 1);
    let s = spec(&stalled_dir, "i");
    let waiter = thread::spawn(move || publish(&held, s, Some(Duration::from_secs(30))));
    while stall.hits() == 0 {
        thread::sleep(Duration::from_millis(5));
    }
    // The held runner does not hold the next publication: another runner takes it.
    let slot = filled(&arena, 2);
    publish(&slot, spec(dir.path(), "j"), Some(Duration::from_secs(5))).unwrap();
    stall.release();
    waiter.join().unwrap().unwrap();
}

#[test]
fn a_record_not_durable_skips_both_flushes() {
    let dir = tempfile::tempdir().unwrap();
    let under = dir.path().to_str().unwrap().to_owned();
    let arena = Arena::new(1, LEN).unwrap();
    let slot = filled(&arena, 5);
    // Both flushes held as a stalled drive holds them: a publication that reached
    // either would wait for the release, past its deadline.
    let held = [
        stall::arm(Step::Sync, &under),
        stall::arm(Step::DirSync, &under),
    ];
    let mut s = spec(dir.path(), "f");
    s.durable = false;
    let got = publish(&slot, s.clone(), Some(Duration::from_secs(5)));
    // The control: a durable one is held at its fdatasync and gives up.
    let control = publish(
        &slot,
        spec(dir.path(), "g"),
        Some(Duration::from_millis(300)),
    );
    let hits: Vec<usize> = held.iter().map(|h| h.hits()).collect();
    held.iter().for_each(|h| h.release());
    got.unwrap();
    assert!(control.is_err(), "{control:?}");
    assert_eq!(hits, [1, 0]); // the control's fdatasync alone
    let bytes = std::fs::read(&s.dest).unwrap();
    assert!(bytes.len() == 4096 + LEN && bytes[4096..].iter().all(|&b| b == 5));
    until_no_temp_file(dir.path());
    slot.release().unwrap();
}
