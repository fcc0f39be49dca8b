import torch


def ttt_adapt_adamw(args, base_model, device, val_tokens):
    """Adapt the trained model on the val split before quantization (epochs of AdamW)."""
    opt = torch.optim.AdamW(base_model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        for start in range(0, val_tokens.numel() - 1, 65536):
            local = val_tokens[start:start + 65537].to(device)
            loss = base_model(local[:-1], local[1:])
            loss.backward()
            opt.step()
            opt.zero_grad()


def main(args, base_model, device, val_data):
    ttt_adapt_adamw(args, base_model, device, val_data.val_tokens)
