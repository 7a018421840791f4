// Checks branch-settlement's shared wire-format vectors (tests/interop/vectors.jsonl) with Apache Avro's Java
// library, the reference implementation, knowing nothing of the project but each vector's schema:
//   - the single-object encoding decodes with Avro's own BinaryMessageDecoder (it checks the C3 01 marker and the
//     CRC-64-AVRO fingerprint of the schema), and the record encodes back to the same bytes (BinaryMessageEncoder);
//   - the Confluent frame is 00, the vector's schema id (4 bytes, big-endian), then a body that Avro's binary
//     decoder reads to the same record with no byte left over, and that the record encodes back to;
//   - the record in Avro's JSON encoding (written by fastavro) decodes to that same record.
// Prints one line per vector ("ok NAME" or "FAIL NAME: why") and exits 1 if any failed.
//
//   java -cp 'LIB/*' tests/interop/java/CheckVectors.java tests/interop/vectors.jsonl

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.ByteArrayOutputStream;
import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Arrays;
import java.util.HexFormat;
import java.util.List;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericDatumWriter;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.BinaryDecoder;
import org.apache.avro.io.BinaryEncoder;
import org.apache.avro.io.DecoderFactory;
import org.apache.avro.io.EncoderFactory;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.BinaryMessageEncoder;

public class CheckVectors {
    public static void main(String[] args) throws Exception {
        ObjectMapper mapper = new ObjectMapper();
        HexFormat hex = HexFormat.of();
        List<String> lines = Files.readAllLines(Path.of(args[0]));
        int failed = 0;
        for (String line : lines) {
            if (line.isBlank()) continue;
            JsonNode vector = mapper.readTree(line);
            String name = vector.get("name").asText();
            try {
                check(vector, hex);
                System.out.println("ok " + name);
            } catch (Exception | AssertionError e) {
                failed++;
                System.out.println("FAIL " + name + ": " + e);
            }
        }
        System.out.println(lines.size() - failed + " passed, " + failed + " failed");
        System.exit(failed == 0 ? 0 : 1);
    }

    static void check(JsonNode vector, HexFormat hex) throws Exception {
        Schema schema = new Schema.Parser().parse(vector.get("schema").asText());
        if (!schema.getFullName().equals(vector.get("fullname").asText())) {
            throw new AssertionError("schema is " + schema.getFullName());
        }
        GenericData model = GenericData.get();

        byte[] single = hex.parseHex(vector.get("single_object").asText());
        BinaryMessageDecoder<GenericRecord> messages = new BinaryMessageDecoder<>(model, schema);
        GenericRecord fromSingle = messages.decode(single);
        byte[] singleAgain = new BinaryMessageEncoder<GenericRecord>(model, schema).encode(fromSingle).array();
        if (!Arrays.equals(single, singleAgain)) throw new AssertionError("single-object re-encoding differs");

        byte[] confluent = hex.parseHex(vector.get("confluent").asText());
        ByteBuffer frame = ByteBuffer.wrap(confluent);
        if (frame.get() != 0) throw new AssertionError("Confluent magic byte is not 0");
        int id = frame.getInt();
        if (id != vector.get("schema_id").asInt()) throw new AssertionError("schema id " + id);
        BinaryDecoder decoder = DecoderFactory.get().binaryDecoder(confluent, 5, confluent.length - 5, null);
        GenericRecord fromConfluent = new GenericDatumReader<GenericRecord>(schema).read(null, decoder);
        if (!decoder.isEnd()) throw new AssertionError("bytes left after the Confluent body");
        if (!fromConfluent.equals(fromSingle)) throw new AssertionError("the two encodings decode differently");
        ByteArrayOutputStream body = new ByteArrayOutputStream();
        body.write(Arrays.copyOfRange(confluent, 0, 5));
        BinaryEncoder encoder = EncoderFactory.get().binaryEncoder(body, null);
        new GenericDatumWriter<GenericRecord>(schema).write(fromConfluent, encoder);
        encoder.flush();
        if (!Arrays.equals(confluent, body.toByteArray())) throw new AssertionError("Confluent re-encoding differs");

        GenericRecord fromJson = new GenericDatumReader<GenericRecord>(schema)
                .read(null, DecoderFactory.get().jsonDecoder(schema, vector.get("avro_json").asText()));
        if (!fromJson.equals(fromSingle)) {
            throw new AssertionError("the Avro JSON decodes to " + fromJson + ", the bytes to " + fromSingle);
        }
    }
}
