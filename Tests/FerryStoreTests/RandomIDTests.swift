@testable import FerryStore
import Foundation
import Testing

/// Outbox event and batch ids: the same text form as `UUID().uuidString.lowercased()`, without a file per id.
@Suite struct RandomIDTests {
    @Test func bitsBecomeAVersion4UUIDText() {
        #expect(RandomID.uuidV4(high: 0, low: 0) == "00000000-0000-4000-8000-000000000000")
        #expect(RandomID.uuidV4(high: .max, low: .max) == "ffffffff-ffff-4fff-bfff-ffffffffffff")
        #expect(
            RandomID.uuidV4(high: 0x0123_4567_89AB_CDEF, low: 0xFEDC_BA98_7654_3210)
                == "01234567-89ab-4def-bedc-ba9876543210")
    }

    @Test func randomIDsParseAsUUIDsAndDoNotRepeat() {
        var seen = Set<String>()
        for _ in 0..<10_000 {
            let id = RandomID.uuidV4()
            #expect(id.count == 36 && id == id.lowercased())
            let parsed = UUID(uuidString: id)
            #expect(parsed?.uuidString.lowercased() == id)
            let bytes = Array(id.utf8)
            #expect(bytes[14] == UInt8(ascii: "4") && "89ab".utf8.contains(bytes[19]), "\(id)")
            seen.insert(id)
        }
        #expect(seen.count == 10_000)
    }

    /// The random bytes are drawn from one shared pool: ids made on many threads at once never repeat.
    @Test func idsMadeConcurrentlyDoNotRepeat() async {
        let batches = await withTaskGroup(of: [String].self) { group in
            for _ in 0..<8 { group.addTask { (0..<500).map { _ in RandomID.uuidV4() } } }
            return await group.reduce(into: [[String]]()) { $0.append($1) }
        }
        #expect(Set(batches.joined()).count == 8 * 500)
    }
}
