// A producer and a consumer on BlazingMQ's Java SDK (bloomberg/blazingmq-sdk-java) against
// this cluster's bmqp port, in one session: it posts a message with properties and receives
// it back through a subscription. README "Applications on BlazingMQ's SDKs" says how it was
// built and run here; BMQ_BROKER_URI overrides the broker (default tcp://localhost:30114, node
// 1 of `bmqctl cluster up`).

import com.bloomberg.bmq.AbstractSession;
import com.bloomberg.bmq.MessageProperties;
import com.bloomberg.bmq.PushMessage;
import com.bloomberg.bmq.PutMessage;
import com.bloomberg.bmq.Queue;
import com.bloomberg.bmq.QueueFlags;
import com.bloomberg.bmq.QueueOptions;
import com.bloomberg.bmq.Session;
import com.bloomberg.bmq.SessionOptions;
import com.bloomberg.bmq.Subscription;
import com.bloomberg.bmq.Uri;
import java.net.URI;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

public class HelloSdk {
    public static void main(String[] args) throws Exception {
        String broker = System.getenv().getOrDefault("BMQ_BROKER_URI", "tcp://localhost:30114");
        Uri uri = new Uri("bmq://bmq.test.mmap.priority/hello-java");
        Duration timeout = Duration.ofSeconds(15);
        CountDownLatch got = new CountDownLatch(1);

        AbstractSession session =
                new Session(SessionOptions.builder().setBrokerUri(URI.create(broker)).build(), e -> {});
        session.start(timeout);
        long flags = QueueFlags.setAck(QueueFlags.setWriter(QueueFlags.setReader(0)));
        Queue queue =
                session.getQueue(
                        uri,
                        flags,
                        event -> {},
                        ack -> System.out.println("ack " + ack.status()),
                        (PushMessage msg) -> {
                            StringBuilder text = new StringBuilder();
                            for (ByteBuffer b : msg.payload()) {
                                text.append(StandardCharsets.UTF_8.decode(b));
                            }
                            System.out.println("received " + text);
                            msg.confirm();
                            got.countDown();
                        });
        // Only messages whose property "kind" is "greeting" reach this reader.
        Subscription greetings =
                Subscription.builder().setExpressionText("kind == \"greeting\"").build();
        queue.open(QueueOptions.builder().addSubscription(greetings).build(), timeout);

        PutMessage put =
                queue.createPutMessage(
                        ByteBuffer.wrap("hello from Java".getBytes(StandardCharsets.UTF_8)));
        put.setCorrelationId();
        MessageProperties properties = put.messageProperties();
        properties.setPropertyAsString("kind", "greeting");
        queue.post(put);

        System.out.println("delivered: " + got.await(10, TimeUnit.SECONDS));
        queue.close(timeout);
        session.stop(timeout);
        session.linger();
    }
}
